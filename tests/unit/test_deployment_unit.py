"""docs/ops/headwater.service and the configuration of docs/deployment.md hold together.

``systemd-analyze verify`` (Debian's systemd; it needs no running systemd) checks the
unit's syntax and every key, with ExecStart pointed at this checkout's ``headwater``;
the ExecStart command line parses with headwater's own CLI parser; the data directory
and the config are where the unit's StateDirectory and ConfigurationDirectory put them;
LimitNOFILE covers the default limits; the TOML of docs/deployment.md is a config the
server accepts (unknown keys are refused, so a misspelt key there fails here).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from headwater.cli.main import build_parser
from headwater.server.config import LimitsConfig, config_from_dict

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "docs" / "ops" / "headwater.service"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
INSTALLED_BINARY = "/opt/headwater/venv/bin/headwater"


def unit_keys() -> dict[str, dict[str, str]]:
    """Section -> key -> value (the unit has each key once)."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if header := re.fullmatch(r"\[(\w+)\]", line):
            current = sections.setdefault(header.group(1), {})
            continue
        key, _, value = line.partition("=")
        assert key not in current, f"{key} twice"
        current[key] = value
    return sections


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: `make system-deps` installs Debian's systemd"
    headwater = Path(sys.executable).with_name("headwater")
    assert headwater.is_file(), headwater
    unit = tmp_path / "headwater.service"
    text = UNIT.read_text()
    assert INSTALLED_BINARY in text
    unit.write_text(text.replace(INSTALLED_BINARY, str(headwater)))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    # Unknown keys and bad values are warnings with exit status 0: no output at all.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )


def test_exec_start_is_a_serve_command_over_the_units_directories() -> None:
    service = unit_keys()["Service"]
    binary, *args = shlex.split(service["ExecStart"])
    assert binary == INSTALLED_BINARY
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"
    assert parsed.data_dir == Path("/var/lib") / service["StateDirectory"]
    assert parsed.config.parent == Path("/etc") / service["ConfigurationDirectory"]
    assert service["User"] == "headwater" and service["KillSignal"] == "SIGTERM"
    # Exit 1 and 2 (unservable data directory, bad config or port) are not retried.
    assert set(service["RestartPreventExitStatus"].split()) == {"1", "2"}


def test_open_file_limit_covers_the_default_limits() -> None:
    limits = LimitsConfig()
    nofile = int(unit_keys()["Service"]["LimitNOFILE"])
    assert nofile >= 2 * (limits.max_connections + limits.open_files)


def test_the_deployment_guides_config_is_accepted(tmp_path: Path) -> None:
    blocks = re.findall(r"```toml\n(.*?)```", DEPLOYMENT.read_text(), re.S)
    assert len(blocks) == 1
    # The config loader checks that the certificate files exist: here, in tmp_path.
    text = blocks[0]
    for name in ("server.pem", "server.key"):
        assert f'"/etc/headwater/{name}"' in text
        (tmp_path / name).write_text("")
        text = text.replace(f'"/etc/headwater/{name}"', f'"{tmp_path / name}"')
    config = config_from_dict(tomllib.loads(text))
    assert config.tls is not None and config.tls.cert == tmp_path / "server.pem"
    assert config.listen["http"] == "0.0.0.0:7400"
    assert config.limits == LimitsConfig()  # the values shown are the defaults, as it says
