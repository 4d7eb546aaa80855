"""A CPU model's weights moved into huge pages while idle (preheat.workers.engine.hugepages):
the bookkeeping on a module of its own, then through the real scheduler and a dev model,
whose answers are transformers' before and after the move."""

from __future__ import annotations

import pytest
import torch

from preheat.workers.engine import hugepages
from preheat.workers.engine.hugepages import HugePageWeights
from tests.conftest import greedy, load_resident, new_scheduler, reference_generate, support_request


def advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` is advised for huge pages (`hg` in its VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


class Tied(torch.nn.Module):
    """Parameters of several dtypes and sizes, one tied under two names, as an LM head is."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 40)
        self.head = torch.nn.Linear(40, 300, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.randn(40))
        self.scale = torch.nn.Parameter(torch.randn(7, 33).to(torch.bfloat16))


def test_each_parameter_takes_its_new_pages_once_whole_with_the_same_bits(monkeypatch):
    monkeypatch.setattr(hugepages, "QUANTUM", 4096)  # a parameter over several pieces
    model = Tied()
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    old = {id(p): p.data_ptr() for p in model.parameters()}
    moving = HugePageWeights("tied", model)
    assert [p.numel() for p in moving.parameters] == [40, 231, 12000]  # its own first, the tied weight once
    assert moving.move_next()  # the two small ones and 3,474 bytes of the embedding's 48,000
    assert model.embed.weight.data_ptr() == old[id(model.embed.weight)]
    calls = 2
    while moving.move_next():
        calls += 1
    assert calls == 12  # 160 + 462 + 48,000 bytes, 4,096 a piece
    assert not moving.left()
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p.detach(), before[name]), name
        assert p.data_ptr() != old[id(p)] and p.data_ptr() % hugepages.ALIGN == 0
    assert model.head.weight is model.embed.weight
    assert model.norm.data_ptr() % hugepages.HUGE_PAGE == 0  # the first on a huge page's boundary
    assert not advised_huge(before["norm"].data_ptr())
    if hugepages.why_not(torch.device("cpu")) is None:  # where the host has them: the move's point
        assert advised_huge(model.norm.data_ptr())


def test_nothing_moves_where_huge_pages_are_off_or_on_another_device(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_MODE", mode)
    assert HugePageWeights.of("tied", Tied(), torch.device("cpu")) is None
    assert hugepages.why_not(torch.device("cpu")) == "transparent huge pages are off (never)"
    mode.write_text("always [madvise] never\n")
    assert hugepages.why_not(torch.device("cpu")) is None
    assert hugepages.why_not(torch.device("meta")) == "weights on meta"
    monkeypatch.setattr(hugepages, "THP_MODE", tmp_path / "absent")
    assert hugepages.why_not(torch.device("cpu")) == "this kernel has no transparent huge pages"


@pytest.mark.skipif(hugepages.why_not(torch.device("cpu")) is not None, reason="no transparent huge pages here")
def test_a_model_answers_as_transformers_before_and_after_its_weights_move(tiny_model):
    resident = load_resident(tiny_model)
    scheduler = new_scheduler()
    try:
        prompt = support_request(resident, "Where is my parcel?")[1]
        expected = reference_generate(resident, prompt, 8)
        scheduler.compile(resident.runner, "off", None, resident.content_digest)  # its idle work starts here
        for _ in range(200):
            if resident.runner.idle_work() is None:
                break
            assert scheduler.submit(resident, prompt, greedy(8)).collect().token_ids == expected
        assert resident.runner.idle_work() is None, "the weights were not moved while the scheduler was idle"
        assert all(advised_huge(p.data_ptr()) for p in resident.model.parameters())
        assert scheduler.submit(resident, prompt, greedy(8)).collect().token_ids == expected
        assert reference_generate(resident, prompt, 8) == expected
    finally:
        scheduler.close()
