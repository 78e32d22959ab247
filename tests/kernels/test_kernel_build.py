"""The lock around the first build of the C++ CPU kernels (pagedllm/kernels/cpu.py).

A build killed half-way (a server stopped during start-up) leaves torch's own ``lock``
file behind, and torch's ``FileBaton.wait`` polls for it with no deadline; a CI run once
hung on it for 90 minutes. ``_build_lock`` must remove such a leftover, wait for a live
builder, and give up after its deadline instead of hanging.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pagedllm.kernels.cpu import _build_lock, _compilers_in, build_wait_s

# timing-sensitive: run alone, after the parallel part of `make test`
pytestmark = pytest.mark.serial


def _hold_flock(path: str) -> subprocess.Popen:
    """A child process that holds an exclusive flock on ``path`` until killed."""
    code = textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({path!r}, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_stale_torch_lock_is_removed(tmp_path):
    build_dir = tmp_path / "pagedllm_cpu_x"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")          # left by a builder that was killed
    with _build_lock(str(build_dir), wait_s=5) as why_not:
        assert why_not is None
        assert not (build_dir / "lock").exists()


def test_live_builder_is_waited_for_then_given_up_on(tmp_path):
    build_dir = tmp_path / "pagedllm_cpu_y"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")          # the live builder's own torch lock
    proc = _hold_flock(str(build_dir) + ".flock")
    try:
        t0 = time.monotonic()
        with _build_lock(str(build_dir), wait_s=1.0) as why_not:
            assert why_not == f"another process held {build_dir}.flock for 1 s"
        assert 1.0 <= time.monotonic() - t0 < 10
        assert (build_dir / "lock").exists()      # a live builder's lock is left alone
    finally:
        proc.kill()
        proc.wait()
    # The kernel dropped the dead holder's flock: the next start gets it at once.
    t0 = time.monotonic()
    with _build_lock(str(build_dir), wait_s=30) as why_not:
        assert why_not is None
        assert not (build_dir / "lock").exists()
    assert time.monotonic() - t0 < 5


def test_waiter_proceeds_when_builder_finishes(tmp_path):
    build_dir = tmp_path / "pagedllm_cpu_z"
    build_dir.mkdir()
    proc = _hold_flock(str(build_dir) + ".flock")
    try:
        threading.Timer(1.0, proc.kill).start()
        t0 = time.monotonic()
        with _build_lock(str(build_dir), wait_s=60) as why_not:
            assert why_not is None
        assert 0.9 <= time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait()


def test_lock_is_released_on_exit(tmp_path):
    build_dir = tmp_path / "pagedllm_cpu_w"
    build_dir.mkdir()
    with _build_lock(str(build_dir), wait_s=0.0) as why_not:
        assert why_not is None
    with _build_lock(str(build_dir), wait_s=0.0) as why_not:    # no wait: must be free now
        assert why_not is None


@pytest.mark.parametrize("stale_lock", [True, False])
def test_orphaned_compiler_of_a_killed_build_is_waited_for(tmp_path, stale_lock):
    """Killing the Python builder alone leaves its compilers running; with SIGINT torch
    even removes its ``lock`` first. Either way the next build waits for them."""
    build_dir = tmp_path / "pagedllm_cpu_v"
    build_dir.mkdir()
    if stale_lock:
        (build_dir / "lock").write_text("")
    # Stands for the cc1plus left running in the build directory.
    fake_compiler = tmp_path / "cc1plus"
    fake_compiler.symlink_to(shutil.which("sleep"))
    orphan = subprocess.Popen([str(fake_compiler), "600"], cwd=build_dir)
    try:
        deadline = time.monotonic() + 10
        while not _compilers_in(str(build_dir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _compilers_in(str(build_dir)) == [orphan.pid]
        with _build_lock(str(build_dir), wait_s=1.0) as why_not:
            assert why_not.startswith(f"compiler processes [{orphan.pid}] of an interrupted build")
        assert (build_dir / "lock").exists() == stale_lock
        threading.Timer(1.0, orphan.kill).start()
        with _build_lock(str(build_dir), wait_s=60) as why_not:
            assert why_not is None
            assert not (build_dir / "lock").exists()
    finally:
        orphan.kill()
        orphan.wait()


def test_other_programs_in_the_build_dir_are_not_compilers(tmp_path):
    build_dir = tmp_path / "pagedllm_cpu_u"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")
    shell = subprocess.Popen(["sleep", "600"], cwd=build_dir)   # e.g. a user's shell there
    try:
        t0 = time.monotonic()
        with _build_lock(str(build_dir), wait_s=30) as why_not:
            assert why_not is None
        assert time.monotonic() - t0 < 5
    finally:
        shell.kill()
        shell.wait()


@pytest.mark.parametrize("raw, want", [(None, 1200.0), ("30", 30.0), ("0", 0.0), ("abc", 1200.0),
                                       ("", 1200.0), ("nan", 1200.0), ("inf", 1200.0), ("-5", 1200.0)])
def test_build_wait_setting(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("PAGEDLLM_KERNEL_BUILD_WAIT_S", raising=False)
    else:
        monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_WAIT_S", raw)
    assert build_wait_s() == want
