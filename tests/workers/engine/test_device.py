import pytest
import torch

from preheat.workers.engine.device import pick_placement


def test_auto_is_the_precision_the_cpu_computes_and_dtype_can_be_forced(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from preheat.workers.engine import device

    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert pick_placement("auto").describe() == "cpu/bfloat16"
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert pick_placement("auto").describe() == "cpu/bfloat16"
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert pick_placement("auto").describe() == "cpu/float32"  # bf16 emulated is slower
    # The catalog's dtype wins over PREHEAT_DTYPE, which wins over the hardware's choice.
    assert pick_placement("cpu", "bfloat16", "float32").describe() == "cpu/bfloat16"
    assert pick_placement("cpu", "auto", "float32").describe() == "cpu/float32"
    assert pick_placement("cpu", "auto", "bfloat16").describe() == "cpu/bfloat16"


def test_cuda_without_a_device_is_a_clear_error():
    if torch.cuda.is_available():
        assert pick_placement("auto").device.type == "cuda"
        assert pick_placement("auto").dtype in (torch.bfloat16, torch.float16)
        return
    with pytest.raises(RuntimeError, match="PREHEAT_DEVICE=cuda but no CUDA device is visible"):
        pick_placement("cuda")


# Out of memory: what the allocators raise, turned into one error naming the work. (The
# CPU allocator's real failure, under a capped data segment, is in tests/test_faults.py.)


def test_cuda_out_of_memory_becomes_one_error_naming_the_work():
    from preheat.core.errors import DeviceOutOfMemory
    from preheat.workers.engine.device import out_of_memory_as_error

    def allocate():
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.10 GiB of which 1.06 GiB is free."
        )

    with pytest.raises(
        DeviceOutOfMemory,
        match=r"^out of memory on cuda while pre-filling support: "
        r"CUDA out of memory\. Tried to allocate 2\.00 GiB\.$",
    ) as raised:
        out_of_memory_as_error(torch.device("cuda"), "pre-filling support", allocate)
    assert raised.value.__context__ is None  # nothing keeps the failed work's frames alive


def test_other_errors_pass_through_and_no_error_is_no_error():
    from preheat.workers.engine.device import out_of_memory_as_error

    def mismatch():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        out_of_memory_as_error(torch.device("cpu"), "decoding", mismatch)
    assert out_of_memory_as_error(torch.device("cpu"), "decoding", lambda: 42) == 42
