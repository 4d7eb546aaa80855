import pytest
import torch

from workers.device import pick_placement


def test_cpu_is_float32_and_dtype_can_be_forced():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert pick_placement("auto").describe() == "cpu/float32"
    assert pick_placement("cpu", "bfloat16").describe() == "cpu/bfloat16"


def test_cuda_without_a_device_is_a_clear_error():
    if torch.cuda.is_available():
        assert pick_placement("auto").device.type == "cuda"
        assert pick_placement("auto").dtype in (torch.bfloat16, torch.float16)
        return
    with pytest.raises(RuntimeError, match="PREHEAT_DEVICE=cuda but no CUDA device is visible"):
        pick_placement("cuda")
