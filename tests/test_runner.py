"""The worker split by device: one runner protocol (``worker/runner.py``), a CPU and a CUDA
implementation, one factory. Their tokens are compared step by step in
``test_triton_kernels.test_gpu_step_path_matches_cpu_runner`` (the CUDA runner on CPU tensors,
under Triton's interpreter), and for MoE, MLA, FP8 and the batch-invariant mode in the other
``test_triton_*`` files."""

from __future__ import annotations

import inspect

import torch
from test_imports import GRAPH
from test_triton_kernels import _tiny_runner

from pdinfer.config import EngineArgs
from pdinfer.worker.cpu_runner import CpuRunner
from pdinfer.worker.gpu_runner import GpuRunner
from pdinfer.worker.runner import StepRunner, make_runner

IMPLEMENTATIONS = (CpuRunner, GpuRunner)


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(StepRunner).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_the_factory_gives_the_cpu_runner_for_a_cpu_device():
    cpu = _tiny_runner()
    options = EngineArgs().runner_options
    runner = make_runner(cpu.spec, "", "dummy", torch.float32, torch.device("cpu"), options, seed=3)
    assert type(runner) is CpuRunner and not runner.async_results
    assert isinstance(runner, StepRunner)


def test_both_runners_have_the_protocols_methods_with_its_parameters():
    methods = _protocol_methods()
    assert {"profile_num_blocks", "init_cache", "require_cache", "capture_cuda_graphs", "execute"} <= set(methods)
    for cls in IMPLEMENTATIONS:
        for name, expected in methods.items():
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(expected.parameters), (cls.__name__, name)
            defaults = [p.default for p in got.parameters.values()]
            assert defaults == [p.default for p in expected.parameters.values()], (cls.__name__, name)


def test_both_runners_hold_the_protocols_attributes():
    attributes = set(StepRunner.__annotations__)
    assert {"model", "spec", "device", "dtype", "kv_dtype", "moe_layers", "dispatcher", "keep_hidden"} <= attributes
    cpu, gpu = _tiny_runner(), _tiny_runner(gpu=True)  # the CUDA runner on CPU tensors
    for runner in (cpu, gpu):
        assert isinstance(runner, StepRunner)  # every member, attributes included
        runner.init_cache(num_blocks=8, block_size=4)
        assert runner.require_cache() is runner.cache
    cpu.capture_cuda_graphs(4, 32)  # a no-op on the CPU
    assert (cpu.async_results, gpu.async_results) == (False, True)


def test_neither_runner_imports_the_other():
    def reaches(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for target in GRAPH[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        return seen

    cpu, gpu = "pdinfer.worker.cpu_runner", "pdinfer.worker.gpu_runner"
    assert gpu not in reaches(cpu) and cpu not in reaches(gpu)
    assert {cpu, gpu} <= reaches("pdinfer.worker.runner")  # the factory picks between them
    assert not {cpu, gpu} & reaches("pdinfer.worker.executor")  # it knows runners by the protocol
