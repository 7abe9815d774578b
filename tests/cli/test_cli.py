"""mxfp4conv/cli.py: the command-line contract (README "Exit codes"): 0 ok, 1 input or output rejected, 2 usage,
3 verification failed, 123 internal error; errors are one line on stderr (``--debug`` / MXFP4CONV_DEBUG=1 add
the traceback); with ``--json`` stdout holds exactly one JSON document, and nothing else goes to stdout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mxfp4conv import __version__
from mxfp4conv.cli import cli, parse_size
from mxfp4conv.errors import EXIT_INTERNAL, EXIT_INVALID, EXIT_OK, EXIT_USAGE, EXIT_VERIFY
from mxfp4conv.plan import inspect as inspect_mod
from tests.builders import build


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, list(args), env=env)
    return res.exit_code, res.stdout, res.stderr


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("ct-mxfp4", tmp_path_factory.mktemp("cli") / "src", shards=1)


@pytest.fixture(scope="module")
def converted(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("cli-out") / "dst"
    code, _, err = run("convert", str(src), str(dst), "--to", "quark")
    assert code == EXIT_OK, err
    return dst


def test_exit_code_constants() -> None:
    assert (EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_VERIFY, EXIT_INTERNAL) == (0, 1, 2, 3, 123)


# ---------------------------------------------------------------------------------------------- 0, stdout/stderr


def test_version_and_help() -> None:
    code, out, _ = run("--version")
    assert code == 0 and out.strip() == f"mxfp4conv, version {__version__}"
    code, out, _ = run("--help")
    assert code == 0
    assert "0 ok, 1 input rejected" in out and "3 verification failed" in out and "123 internal error" in out


def test_human_output_goes_to_stderr(src: Path) -> None:
    code, out, err = run("inspect", str(src))
    assert code == 0 and out == ""
    assert "ct-mxfp4" in err and "ok: complete and consistent" in err


@pytest.mark.parametrize("command", ["inspect", "convert", "verify"])
def test_json_is_exactly_one_document(src: Path, converted: Path, tmp_path: Path, command: str) -> None:
    args = {"inspect": [str(src)], "convert": [str(src), str(tmp_path / "o"), "--to", "ct"],
            "verify": [str(src), str(converted)]}[command]
    # a real process: whatever any library prints to stdout would show up here
    res = subprocess.run([sys.executable, "-m", "mxfp4conv", command, *args, "--json"], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    doc = json.loads(out)  # raises on anything besides one document ("Extra data")
    assert isinstance(doc, dict) and doc
    assert out.strip().startswith("{") and out.strip().endswith("}")


@pytest.mark.parametrize(("argv", "code"), [(["inspect", "{src}", "--json"], 0), (["convert", "{src}", "{tmp}/o", "--to", "ct"], 0),
                                             (["verify", "{src}", "{tmp}/missing"], 1), (["convert", "{src}", "{tmp}/o2", "--to", "nope"], 2)])
def test_the_console_script_skips_teardown_but_not_its_exit_code_or_output(src: Path, tmp_path: Path, argv: list[str],
                                                                            code: int) -> None:
    """``main`` ends the process once the command is done (no interpreter teardown: atexit handlers do
    not run), with the command's exit code and every byte it printed."""
    args = [a.format(src=src, tmp=tmp_path) for a in argv]
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('TEARDOWN', file=sys.stderr))\n"
              f"sys.argv = ['mxfp4conv', *{args!r}]\n"
              "from mxfp4conv.cli import main\n"
              "main()\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == code, res.stderr
    assert "TEARDOWN" not in res.stderr
    if argv[0] == "inspect":
        assert json.loads(res.stdout)["layout"] == "ct-mxfp4"  # the whole document, flushed
    elif code:
        assert res.stderr.strip().splitlines()[-1].startswith(("error:", "Error:", "Usage:")), res.stderr
    else:
        assert (tmp_path / "o" / "mxfp4conv.json").is_file()


def test_verify_ok_in_words(src: Path, converted: Path) -> None:
    code, out, err = run("verify", str(src), str(converted))
    assert code == 0 and out == ""
    (line,) = error_lines(err)
    assert line.startswith("verified: ") and line.endswith(" tensors match")


# ---------------------------------------------------------------------------------------------- 1


def test_an_input_error_is_one_line_and_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    code, out, err = run("inspect", str(missing), "--json")
    assert code == EXIT_INVALID and out == ""  # no half document on stdout
    (line,) = error_lines(err)
    assert line.startswith("error: ") and str(missing) in line
    assert "Traceback" not in err


def test_an_existing_destination_is_exit_1_and_left_alone(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, _, err = run("convert", str(src), str(dst))
    assert code == EXIT_INVALID
    (line,) = error_lines(err)
    assert line.startswith("error: ") and "--overwrite" in line
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"


def test_a_destination_inside_the_source_is_exit_1(src: Path, tmp_path: Path) -> None:
    own = tmp_path / "src"
    shutil.copytree(src, own)
    code, _, err = run("convert", str(own), str(own / "out"))
    assert code == EXIT_INVALID and len(error_lines(err)) == 1
    assert not (own / "out").exists()


# ---------------------------------------------------------------------------------------------- 2


@pytest.mark.parametrize(("args", "mentions"), [
    (["--max-shard-size", "5XB"], "'5XB' is not a size"),
    (["--max-shard-size", "0"], "must be positive"),
    (["--partition", "2/2"], "--partition"),
    (["--partition", "one"], "--partition"),
    (["--devices", "a,b"], "--devices"),
    (["--device", "tpu"], "--device"),
    (["--to", "onnx"], "--to"),
    (["--tp-size", "0"], "--tp-size"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_usage_errors_are_exit_2_before_any_work(src: Path, tmp_path: Path, args: list[str], mentions: str) -> None:
    code, out, err = run("convert", str(src), str(tmp_path / "o"), *args)
    assert code == EXIT_USAGE, err
    assert mentions in err and "Traceback" not in err and out == ""
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))


def test_verify_device_is_validated(src: Path, converted: Path) -> None:
    code, _, err = run("verify", str(src), str(converted), "--device", "gpu0")
    assert code == EXIT_USAGE and "--device" in err


@pytest.mark.parametrize(("text", "want"), [
    ("5GB", 5 * 1000**3), ("500MB", 500 * 1000**2), ("2GiB", 2 * 1024**3), ("1.5 gb", 1_500_000_000),
    ("40KB", 40_000), ("7", 7), ("3KiB", 3072),
])
def test_parse_size(text: str, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "0", "5 XB", "1e3"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_size(text)


# ---------------------------------------------------------------------------------------------- 3


def test_a_difference_is_exit_3_with_one_line_per_mismatch(src: Path, converted: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    shutil.copytree(converted, dst)
    shard = dst / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last tensor's data
    shard.write_bytes(bytes(raw))
    code, out, err = run("verify", str(src), str(dst))
    assert code == EXIT_VERIFY and out == ""
    lines = error_lines(err)
    assert lines and all(ln.startswith("mismatch: ") for ln in lines), err
    code, out, _ = run("verify", str(src), str(dst), "--json")
    assert code == EXIT_VERIFY and json.loads(out)["ok"] is False


# ---------------------------------------------------------------------------------------------- 123, --debug


def _boom(src: str, revision: str | None) -> object:
    raise RuntimeError("boom")


def test_an_internal_error_is_exit_123(src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspect_mod, "inspect_checkpoint", _boom)
    code, out, err = run("inspect", str(src), "--json")
    assert code == EXIT_INTERNAL and out == ""
    (line,) = error_lines(err)
    assert line == "internal error: RuntimeError: boom (a bug in mxfp4conv; rerun with --debug and report it)"


def test_debug_adds_the_traceback(src: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    code, _, err = run("inspect", missing, "--debug")
    assert code == EXIT_INVALID
    assert "Traceback (most recent call last)" in err and "InputError" in err
    assert error_lines(err)[-1].startswith("error: ")  # the one line still ends the output
    code, _, err = run("inspect", missing, env={"MXFP4CONV_DEBUG": "1"})
    assert code == EXIT_INVALID and "Traceback (most recent call last)" in err
    monkeypatch.setattr(inspect_mod, "inspect_checkpoint", _boom)
    code, _, err = run("inspect", str(src), "--debug")
    assert code == EXIT_INTERNAL and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


def test_no_traceback_without_debug(tmp_path: Path) -> None:
    code, _, err = run("convert", str(tmp_path / "missing"), str(tmp_path / "o"), env={"MXFP4CONV_DEBUG": "0"})
    assert code == EXIT_INVALID and "Traceback" not in err and len(error_lines(err)) == 1


_SETTLE_PROBE = """
import gc, sys
from mxfp4conv.cli import _collector_settled_at_first_unit
from mxfp4conv.run.pipeline import ConvertOptions, convert

assert "torch" not in sys.modules  # torch is imported by the conversion, as in a fresh command
was = gc.isenabled()
with _collector_settled_at_first_unit(None) as progress:
    convert(sys.argv[1], sys.argv[2], ConvertOptions(target="ct", device="cpu"), on_progress=progress)
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    import torch
    print(sum(isinstance(o, torch.Tensor) for o in gc.garbage))
assert gc.isenabled() == was and gc.get_freeze_count() == 0
"""


def test_the_collector_freezes_no_garbage_of_the_conversions_start(tmp_path: Path) -> None:
    """The collector is off while a conversion starts and on once torch is imported, the start's objects
    then frozen. torch's import leaves a cycle holding the importing thread's frames, locals included
    (the first unit's tensors when a reader imports it): nothing of it may be frozen with them, or
    that memory would never be freed. Afterwards the collector is as it was."""
    src = build("modelopt-nvfp4", tmp_path / "src", layers=2, experts=4, hidden=128, inter=64)
    res = subprocess.run([sys.executable, "-c", _SETTLE_PROBE, str(src), str(tmp_path / "o")], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "0"
