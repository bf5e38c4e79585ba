"""Found by PySpark's data source lookup (top-level ``pyspark_<name>`` modules), so
``spark.read.format("headwater")`` works without a register call."""

from headwater.spark.source import HeadwaterDataSource as DefaultSource

__all__ = ["DefaultSource"]
