"""The memory budget's start-up check and the process memory reading."""

from __future__ import annotations

import dataclasses
import os

from headwater.server.config import LimitsConfig, ServerConfig, config_from_dict
from headwater.server.memory import budget_shares, check_budget, process_memory


def test_the_default_limits_fit_the_default_budget() -> None:
    config = ServerConfig()
    assert sum(budget_shares(config).values()) <= config.limits.memory_mib
    assert check_budget(config) == []


def test_limits_past_the_budget_are_named_in_one_warning() -> None:
    config = config_from_dict({"limits": {"memory_mib": 300, "sql_memory_mib": 512}})
    warnings = check_budget(config)
    assert len(warnings) == 1
    assert "limits.memory_mib = 300" in warnings[0]
    assert "SQL (sql_memory_mib x sql_concurrency) 1024 MiB" in warnings[0]
    small = dataclasses.replace(
        config,
        limits=LimitsConfig(
            memory_mib=300,
            sql_memory_mib=24,
            sql_result_mib=8,
            max_connections=1000,
            read_answers_mib=4,
        ),
    )
    assert check_budget(small) == []
    # Read answers held for clients that have not read them take their share too.
    held = dataclasses.replace(small, limits=dataclasses.replace(small.limits, read_answers_mib=8))
    (warning,) = check_budget(held)
    assert "read answers held for their peers (read_answers_mib) 8 MiB" in warning
    # A result's answer is held too: a larger sql_result_mib takes its share of the budget.
    answers = dataclasses.replace(
        small, limits=dataclasses.replace(small.limits, sql_result_mib=64)
    )
    (warning,) = check_budget(answers)
    assert "SQL results (sql_result_mib x sql_concurrency x 1.5) 192 MiB" in warning


def test_process_memory_reads_this_process() -> None:
    memory = process_memory(os.getpid())
    assert memory is not None
    assert 0 < memory.rss_anon < memory.rss_peak
    assert memory.rss_file > 0
    assert process_memory(2**22 + 12345) is None  # no such process
