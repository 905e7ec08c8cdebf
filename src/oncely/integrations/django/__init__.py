"""oncely in Django: :mod:`oncely.integrations.django.http`, the ``Idempotency-Key`` layer as a
Django middleware (``MIDDLEWARE``) and a view decorator for per-view use.

Needs Django (``pip install 'oncely[django]'``).
"""
