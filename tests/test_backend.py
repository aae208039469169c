"""Backend selection: device kind -> backend name, validated against this build."""

import pytest
import torch
import torch.distributed as dist

import miniddp
from miniddp.launching.spawn import run_on_ranks
from miniddp.process_group import backend as backend_mod
from miniddp.testing import backend_params


def test_mapping_agrees_with_torch_default_map():
    # torch's own device -> backend table is the oracle for the kinds it knows. Importing torch.distributed.fsdp
    # (Transformers does) registers torch's testing backend "fake" for hpu too: not a real one, and not the oracle
    for kind, name in dist.Backend.default_device_backend_map.items():
        if kind in miniddp.DEVICE_BACKENDS and name != "fake":
            assert miniddp.DEVICE_BACKENDS[kind] == name, kind
    assert miniddp.DEVICE_BACKENDS == {"cuda": "nccl", "cpu": "gloo", "xpu": "xccl", "hpu": "hccl", "mlu": "cncl"}


def test_auto_on_cpu_is_gloo():
    assert miniddp.select_backend("cpu") == "gloo"
    assert miniddp.select_backend(torch.device("cpu"), "auto") == "gloo"
    assert miniddp.select_backend(torch.zeros(1).device, " GLOO ") == "gloo"  # names are case/space-insensitive


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default on a machine without GPUs")
def test_default_device_without_accelerator_is_cpu():
    assert miniddp.select_backend() == "gloo"


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        miniddp.select_backend("cpu", "ncl")
    message = str(info.value)
    assert "'ncl'" in message and "gloo" in message and "nccl" in message and "auto" in message


def test_non_string_request_is_a_type_error():
    with pytest.raises(TypeError, match="ddp_backend"):
        miniddp.select_backend("cpu", None)


def test_nccl_for_cpu_tensors_suggests_gloo():
    with pytest.raises(RuntimeError, match="gloo") as info:
        miniddp.select_backend("cpu", "nccl")
    assert "CUDA" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_is_refused():
    with pytest.raises(RuntimeError, match="gloo"):
        miniddp.select_backend("cuda", "nccl")


@pytest.mark.parametrize("kind", ["xpu", "hpu", "mlu"])
def test_vendor_backend_missing_from_build_names_the_fix(kind):
    name = miniddp.DEVICE_BACKENDS[kind]
    if backend_mod._is_available(name):
        pytest.skip(f"{name} is available in this build")
    with pytest.raises(RuntimeError, match=f"'{name}' is not available") as info:
        miniddp.select_backend(kind)
    assert "gloo" in str(info.value)


def test_unknown_device_kind_with_auto():
    with pytest.raises(ValueError, match="no default backend for device kind 'meta'"):
        miniddp.select_backend("meta")
    assert miniddp.select_backend("meta", "gloo") == "gloo"  # an explicit name is fine


def test_device_for_local_rank_on_cpu():
    assert miniddp.device_for_local_rank(3, "cpu") == torch.device("cpu")


class _FakeCuda:
    """Stands in for torch.cuda on a CPU machine, to exercise the GPU branch's logic."""

    def __init__(self, count):
        self.count, self.current = count, None

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current = index


def test_device_for_local_rank_sets_the_current_gpu(monkeypatch):
    fake = _FakeCuda(2)
    monkeypatch.setattr(torch, "cuda", fake)
    assert miniddp.device_for_local_rank(1, "cuda") == torch.device("cuda", 1)
    assert fake.current == 1  # forgetting set_device puts every rank on cuda:0


def test_too_many_processes_per_node_is_explained(monkeypatch):
    monkeypatch.setattr(torch, "cuda", _FakeCuda(2))
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but only 2 cuda") as info:
        miniddp.device_for_local_rank(3, "cuda")
    assert "--nproc-per-node 2" in str(info.value) and "CUDA_VISIBLE_DEVICES" in str(info.value)


def _join_with_auto(rank, world_size, backend):
    env = miniddp.init_distributed(backend=backend, timeout=30)
    t = torch.tensor([float(rank + 1)], device=env.device)
    dist.all_reduce(t)
    return env.backend, str(env.device), dist.get_backend(), t.item()


@pytest.mark.parametrize("backend", backend_params(2))
def test_selected_backend_runs_a_collective(backend):
    requested = "auto" if backend == "nccl" else "gloo"
    results = run_on_ranks(_join_with_auto, 2, args=(requested,), backend=backend, init=False, timeout=60)
    for rank, (chosen, device, active, total) in enumerate(results):
        assert chosen == active == backend
        assert device == ("cpu" if backend == "gloo" else f"cuda:{rank}")
        assert total == 3.0  # 1 + 2 from the two ranks


def test_gloo_may_share_a_device_nccl_may_not(monkeypatch):
    # a one-GPU machine, faked: two gloo ranks take turns on cuda:0; an NCCL rank 1 has no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    with pytest.warns(UserWarning, match="shares cuda:0"):
        assert miniddp.device_for_local_rank(1, "cuda", share=True) == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 but only 1 cuda device"):
        miniddp.device_for_local_rank(1, "cuda")
