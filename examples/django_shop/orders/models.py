from django.db import models


class Charge(models.Model):
    order = models.CharField(max_length=64)
    amount = models.IntegerField()
