"""Spark connector: the ``headwater`` data source (``pip install headwater[spark]``).

>>> df = spark.read.format("headwater").option("stream", "trades").load()  # doctest: +SKIP
"""

from .options import DataLossError
from .source import HeadwaterDataSource, register

__all__ = ["DataLossError", "HeadwaterDataSource", "register"]
