"""The ``headwater`` client commands, run as real subprocesses against a real server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import headwater


def cli(
    *args: str, server: Any = None, env: dict[str, str], stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "headwater.cli.main", *args]
    if server is not None:
        command += ["--server", server if isinstance(server, str) else server.address]
    proc = subprocess.run(
        command, input=stdin, capture_output=True, env=env, timeout=60, check=False
    )
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode()
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc.stdout


def test_stream_append_read_sql_delete(
    shared_server: Any, sdk_stream_name: str, sdk_cli_env: dict[str, str]
) -> None:
    name, env = sdk_stream_name, sdk_cli_env
    created = ok(cli("stream", "create", name, server=shared_server, env=env))
    assert created.startswith(f"created stream {name} (id ")
    again = cli("stream", "create", name, server=shared_server, env=env)
    assert again.returncode == 1
    assert (
        again.stderr.strip().splitlines()
        == [f"headwater: error: StreamAlreadyExists: stream {name!r} already exists"]
        or "StreamAlreadyExists" in again.stderr
    )

    appended = ok(
        cli(
            "append",
            name,
            server=shared_server,
            env=env,
            stdin=b'{"sym": "A", "px": 10}\n{"sym": "B", "px": 11}\n\nplain text\n',
        )
    )
    assert appended.strip() == f"appended 3 events to {name}: offsets 0..2"
    with headwater.connect(shared_server.address) as hw:
        hw.append(name, [b"\xff\x00binary", "tab\there"])

    listed = ok(cli("stream", "list", server=shared_server, env=env))
    row = next(line for line in listed.splitlines() if f" {name} " in line)
    assert " 5 " in row  # next offset
    as_json = json.loads(ok(cli("stream", "list", "--json", server=shared_server, env=env)))
    entry = next(s for s in as_json if s["name"] == name)
    assert entry["next_offset"] == 5 and entry["size_bytes"] > 0

    described = ok(cli("stream", "describe", name, server=shared_server, env=env))
    assert "next offset" in described and "tab\\there" in described

    read = ok(cli("read", name, server=shared_server, env=env))
    assert read.splitlines() == [
        '0\t{"sym": "A", "px": 10}',
        '1\t{"sym": "B", "px": 11}',
        "2\tplain text",
        "3\t0x" + b"\xff\x00binary".hex(),  # not UTF-8: hex
        "4\ttab\\there",
    ]
    page = ok(cli("read", name, "--from", "1", "--limit", "2", server=shared_server, env=env))
    assert [line.split("\t")[0] for line in page.splitlines()] == ["1", "2"]

    sql = f'SELECT json->>\'sym\' AS sym, "offset" FROM {name} WHERE "offset" < $1 ORDER BY 2'
    table = ok(cli("sql", sql, "--param", "2", server=shared_server, env=env))
    assert "sym" in table and "(2 rows)" in table
    assert " A " in table and " B " in table
    rows = ok(cli("sql", sql, "--param", "2", "--format", "json", server=shared_server, env=env))
    assert [json.loads(line) for line in rows.splitlines()] == [
        {"sym": "A", "offset": 0},
        {"sym": "B", "offset": 1},
    ]
    with headwater.connect(shared_server.address) as hw:
        top = hw.query(f"SELECT max(position) FROM {name}").scalar()
    assert isinstance(top, int)
    at = ok(
        cli(
            "sql",
            f"SELECT count(*) AS n FROM {name}",
            "--at",
            str(top),
            "--format",
            "csv",
            server=shared_server,
            env=env,
        )
    )
    assert at.split() == ["n", "4"]  # the first `top` positions: all but the last event
    bad = cli("sql", "SELEKT", server=shared_server, env=env)
    assert bad.returncode == 1 and "QueryParseError" in bad.stderr
    assert "Traceback" not in bad.stderr
    # One line, as docs/cli.md says (DuckDB's parser error has three, with a caret).
    [line] = bad.stderr.splitlines()
    assert line.startswith("headwater: error: QueryParseError:") and "LINE 1: SELEKT" in line

    ok(cli("stream", "delete", name, server=shared_server, env=env))
    listed = ok(cli("stream", "list", server=shared_server, env=env))
    assert f" {name} " not in listed
    gone = cli("read", name, server=shared_server, env=env)
    assert gone.returncode == 1
    assert gone.stderr.strip() == f"headwater: error: StreamNotFound: no stream named {name!r}"


def test_numbers_past_the_wire_are_one_line_not_a_traceback(
    shared_server: Any, sdk_stream_name: str, sdk_cli_env: dict[str, str]
) -> None:
    name, env, big = sdk_stream_name, sdk_cli_env, str(10**20)  # past any u64
    ok(cli("stream", "create", name, server=shared_server, env=env))
    for args, message in (
        (("read", name, "--from", big), "argument --from: must be from 0 to 2**63-1"),
        (("read", name, "--tenant", big), "argument --tenant: must be from 0 to 2**63-1"),
        (("sql", "SELECT 1", "--at", big), "argument --at: must be from 0 to 2**63-1"),
        (("tail", name, "--from", big), "argument --from: offsets are from 0 to 2**63-1"),
        (("tail", name, "--credits", big), "argument --credits: must be from 1 to 4294967295"),
    ):
        proc = cli(*args, server=shared_server, env=env)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].endswith(message), proc.stderr
    # A --param past BIGINT goes as text, for DuckDB to cast.
    out = ok(
        cli(
            "sql",
            "SELECT ?::HUGEINT + 1 AS n",
            "--param",
            big,
            "--format",
            "json",
            server=shared_server,
            env=env,
        )
    )
    assert str(10**20 + 1) in out


def test_values_that_look_like_markup_and_repeated_column_names_are_printed_as_they_are(
    shared_server: Any, sdk_cli_env: dict[str, str]
) -> None:
    # The table was drawn as Rich markup: a value "[/x]" crashed the command (MarkupError,
    # exit 1), "[bold]important[/bold]" lost its brackets and a column "[red]col" printed
    # "col". And --format json made one object of the row: a repeated name kept only its
    # last value.
    sql = "SELECT '[/x]' AS v, '[bold]important[/bold]' AS \"[red]col\""
    table = ok(cli("sql", sql, server=shared_server, env=sdk_cli_env))
    for text in ("[/x]", "[bold]important[/bold]", "[red]col"):
        assert text in table, table
    rows = ok(
        cli(
            "sql",
            "SELECT 'a' AS x, 'b' AS x, 'c' AS x_1",
            "--format",
            "json",
            server=shared_server,
            env=sdk_cli_env,
        )
    )
    assert json.loads(rows) == {"x": "a", "x_2": "b", "x_1": "c"}


def test_append_from_a_file(
    shared_server: Any, sdk_stream_name: str, sdk_cli_env: dict[str, str], tmp_path: Path
) -> None:
    name = sdk_stream_name
    ok(cli("stream", "create", name, server=shared_server, env=sdk_cli_env))
    path = tmp_path / "events.jsonl"
    path.write_text("".join(f'{{"i": {i}}}\n' for i in range(25_000)))
    out = ok(cli("append", name, "--file", str(path), server=shared_server, env=sdk_cli_env))
    assert out.strip() == f"appended 25,000 events to {name}: offsets 0..24999"
    with headwater.connect(shared_server.address) as hw:
        assert hw.query(f"SELECT count(*), max((json->>'i')::INT) FROM {name}").rows == [
            (25_000, 24_999)
        ]
    missing = cli(
        "append", name, "--file", str(tmp_path / "nope"), server=shared_server, env=sdk_cli_env
    )
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_append_stopped_part_way_says_what_it_stored(
    shared_server: Any, sdk_stream_name: str, sdk_cli_env: dict[str, str], tmp_path: Path
) -> None:
    # A line over 4 MiB after 60,000 others (a second chunk of the input): the message
    # said "event 0 ... Nothing was appended." with 60,000 events stored, so a rerun of
    # the fixed input stored them twice. And CR: only a CRLF line end's one is taken.
    name = sdk_stream_name
    ok(cli("stream", "create", name, server=shared_server, env=sdk_cli_env))
    path = tmp_path / "events.txt"
    path.write_bytes(
        b"".join(b"e%d\r\n" % i for i in range(60_000)) + b"x" * (5 << 20) + b"\nlast\n"
    )
    refused = cli("append", name, "--file", str(path), server=shared_server, env=sdk_cli_env)
    assert refused.returncode == 2
    [message] = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert message == (
        "headwater: error: the input's event 60,001 (counting non-empty lines) is 5,242,880"
        " bytes; one event may be at most 4,194,304 bytes (4 MiB). The 60,000 events before"
        f" it were appended to {name} (offsets 0..59999); none from there on."
    ), message
    # The same from a pipe, the line in the chunk of the events before it: those go.
    piped = b"a\nb\n" + b"y" * (5 << 20) + b"\nc\n"
    refused = cli("append", name, server=shared_server, env=sdk_cli_env, stdin=piped)
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(
        f"The 2 events before it were appended to {name} (offsets 60000..60001); none from"
        " there on."
    ), refused.stderr
    ok(cli("append", name, server=shared_server, env=sdk_cli_env, stdin=b"cr\r\r\n\r\n"))
    with headwater.connect(shared_server.address) as hw:
        values = [e.value for e in hw.scan(name, 0)]
    assert values == [b"e%d" % i for i in range(60_000)] + [b"a", b"b", b"cr\r"]


@pytest.mark.parametrize(
    "args",
    [
        ("stream", "list"),
        ("stream", "create", "x"),
        ("append", "x"),
        ("read", "x"),
        ("tail", "x"),
        ("sql", "SELECT 1"),
        ("bench", "produce", "x"),
    ],
)
def test_unreachable_server_is_one_clear_line(
    args: tuple[str, ...], unused_port: int, sdk_cli_env: dict[str, str]
) -> None:
    address = f"127.0.0.1:{unused_port}"
    proc = cli(*args, server=address, env=sdk_cli_env, stdin=b"line\n")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0] == (
        f"headwater: error: cannot connect to headwater at {address}: "
        "connection refused (is `headwater serve` running there?)"
    )
    assert proc.stdout == ""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_tail_follows_live_and_ctrl_c_exits_cleanly(
    shared_server: Any, sdk_stream_name: str, sdk_cli_env: dict[str, str]
) -> None:
    name = sdk_stream_name
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(name)
        hw.append(name, [b"before"])
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "headwater.cli.main"),
                *("tail", name, "--from", "0", "--server", shared_server.address),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=sdk_cli_env,
            # A runner started in the background (CI) ignores SIGINT, and Python keeps an
            # inherited SIG_IGN: give the tail what a terminal user's shell gives it.
            preexec_fn=_default_sigint,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"0\tbefore\n"
            hw.append(name, [b"live 1", b"live 2"])
            assert proc.stdout.readline() == b"1\tlive 1\n"
            assert proc.stdout.readline() == b"2\tlive 2\n"
            proc.send_signal(signal.SIGINT)
            _, stderr = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr.decode()
        assert b"Traceback" not in stderr
        # The tail unsubscribed: later appends still work and nothing is left hanging.
        assert hw.append(name, [b"after"]) == (3, 1)


def test_bench_produce_and_consume(
    shared_server: Any, sdk_stream_name: str, sdk_cli_env: dict[str, str]
) -> None:
    name = sdk_stream_name
    produced = ok(
        cli(
            "bench",
            "produce",
            name,
            "--events",
            "5000",
            "--batch",
            "500",
            "--size",
            "64",
            server=shared_server,
            env=sdk_cli_env,
        )
    )
    assert "produce: 5,000 events" in produced and "events/s" in produced and "MB/s" in produced
    for mode in ("read", "subscribe"):
        consumed = ok(
            cli("bench", "consume", name, "--mode", mode, server=shared_server, env=sdk_cli_env)
        )
        assert f"consume ({mode}): 5,000 events" in consumed and "MB/s" in consumed


def test_serve_and_check_still_listed(sdk_cli_env: dict[str, str]) -> None:
    usage = ok(cli("--help", env=sdk_cli_env))
    for command in ("serve", "check", "stream", "append", "read", "tail", "sql", "bench"):
        assert command in usage
    options = ok(cli("stream", "list", "--help", env=sdk_cli_env))
    assert "--server" in options and "--token" in options and "--tenant" in options


def test_token_and_tenant_options(make_server: Any, sdk_cli_env: dict[str, str]) -> None:
    server = make_server(
        config='[auth]\nrequired = true\n[[auth.tokens]]\ntoken = "s3cret"\n'
        'tenants = [42]\n[[tenants]]\nid = 42\nname = "acme"\n'
    )
    acme = ("--token", "s3cret", "--tenant", "42")
    ok(cli("stream", "create", "acme_events", *acme, server=server, env=sdk_cli_env))
    ok(cli("append", "acme_events", *acme, server=server, env=sdk_cli_env, stdin=b"hi\n"))
    assert ok(cli("read", "acme_events", *acme, server=server, env=sdk_cli_env)) == "0\thi\n"
    refused = cli("stream", "list", server=server, env=sdk_cli_env)
    assert refused.returncode == 1
    assert refused.stderr.startswith("headwater: error: AuthenticationFailed: ")
    env = dict(sdk_cli_env, HEADWATER_TOKEN="s3cret")
    listed = ok(cli("stream", "list", "--tenant", "42", server=server, env=env))
    assert "acme_events" in listed
