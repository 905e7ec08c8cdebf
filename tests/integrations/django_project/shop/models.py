from django.db import models


class Charge(models.Model):
    """One effect of the handler: a charge of an order (several rows = a double charge)."""

    order = models.CharField(max_length=64)
    amount = models.IntegerField()


class Refund(models.Model):
    """A row whose foreign key Django checks only at COMMIT on PostgreSQL and SQLite."""

    charge = models.ForeignKey(Charge, on_delete=models.CASCADE)
