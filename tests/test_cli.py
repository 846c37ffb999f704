"""The `deltaserve` command on the embedded tiny model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltaserve.cli import main


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path_factory.getbasetemp() / "ds-cache"))


def test_generate_prints_text_on_the_embedded_model(capsys):
    assert main(["generate", "Hello, world", "--max-tokens", "12", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.strip(), "the completion should not be empty"


def test_generate_as_a_console_script(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "deltaserve.cli", "generate", "Hi", "--max-tokens", "4", "--seed", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_generate_token_ids_and_seed_reproducible(capsys):
    args = ["generate", "5 6 7", "--prompt-token-ids", "--max-tokens", "8", "--seed", "7"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


@pytest.mark.parametrize(
    "args, field",
    [
        (["generate", "x", "--max-tokens", "0"], "max_tokens"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--top-p", "2"], "top_p"),
        (["generate", "x", "--model", "/nonexistent/dir"], "config.json"),
        (["generate", "99999", "--prompt-token-ids"], "vocabulary"),
        (["make-model", "--preset", "huge", "--out", "/tmp/never"], "preset"),
        (["generate", "x", "--kv-offloading-size", "1GiB", "--kv-offloading-chunk-size", "24"],
         "kv_offloading_chunk_size"),
        (["generate", "x", "--kv-offloading-disk-path", "/tmp/never"], "kv_offloading_disk_size"),
    ],
)
def test_cli_errors_name_the_field(args, field, capsys):
    assert main(args) == 2
    assert field in capsys.readouterr().err


def test_make_model_then_generate(tmp_path, capsys):
    out = str(tmp_path / "tiny")
    assert main(["make-model", "--preset", "tiny", "--out", out, "--seed", "4"]) == 0
    assert os.path.isfile(os.path.join(out, "config.json"))
    capsys.readouterr()
    assert main(["generate", "abc", "--model", out, "--max-tokens", "5", "--cache-memory", "64MiB"]) == 0
    assert capsys.readouterr().out.strip()


def test_offloading_flags_reach_the_engine(tmp_path, capsys):
    from deltaserve.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "--kv-offloading-size", "2GiB", "--kv-offloading-disk-path", "/d",
                                      "--kv-offloading-disk-size", "8GiB", "--kv-offloading-remote",
                                      "mooncake://m:50051", "--kv-offloading-chunk-size", "512",
                                      "--kv-offloading-max-pending-saves", "8"])
    options = engine_options(args)
    assert (options["kv_offloading_size"], options["kv_offloading_disk_path"], options["kv_offloading_disk_size"],
            options["kv_offloading_remote"], options["kv_offloading_chunk_size"],
            options["kv_offloading_max_pending_saves"]) == ("2GiB", "/d", "8GiB", "mooncake://m:50051", 512, 8)
    assert main(["generate", "abc", "--max-tokens", "4", "--kv-offloading-size", "64MiB",
                 "--kv-offloading-disk-path", str(tmp_path / "tier"), "--kv-offloading-disk-size", "64MiB"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("args,field", [
    (["--api-server-count", "0"], "api_server_count"),
    (["--port", "70000"], "port"),
    (["--shutdown-timeout", "-1"], "shutdown_timeout"),
])
def test_serve_option_errors_name_the_field(args, field, capsys):
    assert main(["serve", *args]) == 2
    assert field in capsys.readouterr().err


def test_serve_refuses_a_port_in_use():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--port", str(port), "--cache-memory", "64MiB"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
