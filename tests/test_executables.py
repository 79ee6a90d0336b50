"""Executables' bookkeeping with a stand-in compiler: who compiles a shape, and who waits."""

import threading

import pytest

from jvllm.worker.executables import Executables

pytestmark = pytest.mark.usefixtures("background_compiles")


class _Compiler:
    """Compiles shape s into f"exe-{s}", blocking on shapes listed in `held` until released."""

    def __init__(self, held=(), fail=()):
        self.held, self.fail = set(held), set(fail)
        self.release = threading.Event()
        self.threads: dict[str, str] = {}

    def __call__(self, shape):
        self.threads[shape] = threading.current_thread().name
        if shape in self.held:
            assert self.release.wait(30)
        if shape in self.fail:
            raise RuntimeError(f"cannot compile {shape}")
        return f"exe-{shape}"


def test_a_queued_shape_is_compiled_by_the_step_that_needs_it():
    compiler = _Compiler(held=("a", "b"))
    compiled = Executables(compiler, str)
    compiled.compile_in_background(["a", "b", "c"])  # two threads held: "c" stays queued
    assert compiled.get("c") is None
    assert compiled.wait("c") == "exe-c"
    assert compiler.threads["c"] == threading.current_thread().name
    compiler.release.set()
    compiled.wait_all()
    assert [compiled.get(s) for s in "abc"] == ["exe-a", "exe-b", "exe-c"]
    assert len(compiled) == 3


def test_a_step_waits_for_the_running_compile_of_its_shape():
    compiler = _Compiler(held=("a",))
    compiled = Executables(compiler, str)
    compiled.compile_in_background(["a"])
    threading.Timer(0.2, compiler.release.set).start()
    assert compiled.wait("a") == "exe-a"
    assert compiler.threads["a"].startswith("jvllm-compile")
    assert compiled.wait_seconds >= 0.1


def test_a_failed_background_compile_raises_in_the_step_that_needs_it():
    compiled = Executables(_Compiler(fail=("a",)), str)
    compiled.compile_in_background(["a"])
    with pytest.raises(RuntimeError, match="cannot compile a"):
        compiled.wait("a")
    assert compiled.get("a") is None


def test_cancelled_compiles_are_compiled_on_demand_later():
    compiler = _Compiler(held=("a", "b"))
    compiled = Executables(compiler, str)
    compiled.compile_in_background(["a", "b", "c"])
    compiled.cancel_queued()  # "c" had not started
    compiler.release.set()
    compiled.wait_all()
    assert compiled.get("c") is None
    assert compiled.wait("c") == "exe-c"


def test_with_background_compiles_off_a_shape_compiles_in_the_step_that_needs_it(monkeypatch):
    monkeypatch.setenv("JVLLM_BACKGROUND_COMPILES", "0")
    compiler = _Compiler()
    compiled = Executables(compiler, str)
    compiled.compile_in_background(["a", "b"])
    compiled.wait_all()
    assert compiler.threads == {} and len(compiled) == 0
    assert compiled.wait("a") == "exe-a"
    assert compiler.threads == {"a": threading.current_thread().name}
    monkeypatch.setenv("JVLLM_BACKGROUND_COMPILES", "yes")
    with pytest.raises(ValueError, match="JVLLM_BACKGROUND_COMPILES='yes'; allowed"):
        Executables(compiler, str)
