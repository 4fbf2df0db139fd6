"""Every setting read from the environment is range-checked: finite, within bounds, short
enough to be a path; anything else is one line naming the variable and what was expected, and
the value quoted shortened (exit 2 through doit)."""

from __future__ import annotations

import os

import pytest
from support.doit import run_doit

from pipelines.core.errors import BadInput
from pipelines.core.settings import read_settings

LONG = "9" * 5000  # past Python's 4,300 digits of int(): a traceback if parsed as it is


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("SPARKFORGE_DEPLOY_TIMEOUT", "nan", "a number from 1 to 604,800"),
        ("SPARKFORGE_DEPLOY_TIMEOUT", "inf", "a number from 1 to 604,800"),
        ("SPARKFORGE_DEPLOY_TIMEOUT", "0", "a number from 1 to 604,800"),
        ("SPARKFORGE_STAGE_TIMEOUT", "inf", "a number from 1 to 2,592,000"),
        ("SPARKFORGE_STAGE_TIMEOUT", "-5", "a number from 1 to 2,592,000"),
        ("SPARKFORGE_FETCH_PART_MIB", "1e-6", "a number from 1 to 1,024"),
        ("SPARKFORGE_FETCH_PART_MIB", "1e-7", "a number from 1 to 1,024"),
        ("SPARKFORGE_FETCH_PART_MIB", LONG, "a number from 1 to 1,024"),
        ("SPARKFORGE_FETCH_WORKERS", "inf", "a whole number from 1 to 256"),
        ("SPARKFORGE_FETCH_WORKERS", LONG, "a whole number from 1 to 256"),
        ("SPARKFORGE_FETCH_WORKERS", "5000", "a whole number from 1 to 256"),
        ("SPARKFORGE_FETCH_MAX_MBPS", "nan", "a number from 0.001 to 1,000,000"),
        ("SPARKFORGE_GC_KEEP_BUILDS", LONG, "a whole number from 1 to 10,000"),
        ("SPARKFORGE_GC_TAG_DAYS", LONG, "a number from 0 to 36,500"),
        ("SPARKFORGE_STORE", "/tmp/" + "a" * 10_000, "a path of at most 1024 characters"),
        ("SPARKFORGE_WEIGHTS", "/tmp/" + "b" * 300 + "/w", "a path of at most 1024 characters"),
        ("SPARKFORGE_PROFILES", "x/" * 600, "a path of at most 1024 characters"),
    ],
)
def test_a_setting_out_of_its_range_is_one_line_naming_it(name, value, expected):
    with pytest.raises(BadInput) as refused:
        read_settings({name: value})
    said = str(refused.value)
    assert said.startswith(f"environment {name}=") and f"expected {expected}" in said
    assert len(said) < 200  # the value is quoted shortened, never whole


def test_a_setting_in_range_is_read_as_given():
    settings = read_settings(
        {
            "SPARKFORGE_DEPLOY_TIMEOUT": "300",
            "SPARKFORGE_FETCH_PART_MIB": "8",
            "SPARKFORGE_FETCH_WORKERS": "16",
            "SPARKFORGE_GC_TAG_DAYS": "0",
        }
    )
    assert (settings.deploy_timeout_s, settings.fetch_part_mib) == (300.0, 8.0)
    assert (settings.fetch_workers, settings.gc_tag_days) == (16, 0.0)


def test_a_bad_setting_stops_doit_list_with_exit_2():
    result = run_doit("list", env={**os.environ, "SPARKFORGE_DEPLOY_TIMEOUT": "nan"})
    assert result.returncode == 2
    assert result.stderr == (
        "error: environment SPARKFORGE_DEPLOY_TIMEOUT='nan': expected a number from 1 to 604,800\n"
    )
