"""exit_after: a child ends with its entry's exit code, without the interpreter's teardown."""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from parashift.processes import exit_after


def finishes() -> None:
    print("finished", flush=False)  # exit_after flushes what is still buffered


def fails() -> None:
    raise SystemExit(3)


@pytest.mark.parametrize("entry, code", [(finishes, 0), (fails, 3)])
def test_the_child_exits_with_its_entrys_code(entry, code, tmp_path):
    out = tmp_path / "stdout"
    proc = multiprocessing.get_context("spawn").Process(target=_redirected,
                                                        args=(entry, str(out)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == code
    assert out.read_text() == ("finished\n" if code == 0 else "")


def _redirected(entry, path: str) -> None:
    sys.stdout = open(path, "w")  # noqa: SIM115 - exit_after flushes it; nothing closes it
    exit_after(entry)
