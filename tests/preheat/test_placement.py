"""The fleet's template plan as a pure function: exact placements for budgets that hold
some of a catalog, the busiest pinned more often, and the same plan from the same inputs."""

from __future__ import annotations

import random

from preheat.fleet.placement import Capacity, Demand, holders_of, plan, rounded

MIB = 1024**2


def _demands(*weights: float, nbytes: int = MIB) -> list[Demand]:
    return [Demand(f"t{i}", weight, nbytes) for i, weight in enumerate(weights)]


def test_a_catalog_that_fits_every_worker_is_pinned_on_every_worker():
    workers = {"w1": Capacity(10 * MIB, 5), "w2": Capacity(10 * MIB, 5)}
    assert plan(_demands(3, 2, 1), workers) == {"w1": ["t0", "t1", "t2"], "w2": ["t0", "t1", "t2"]}


def test_three_times_what_one_worker_pins_gives_each_template_one_holder_spread_evenly():
    workers = {f"w{i}": Capacity(100 * MIB, 2) for i in range(1, 4)}  # 2 pins each, 6 templates
    planned = plan(_demands(6, 5, 4, 3, 2, 1), workers)
    assert sorted(len(templates) for templates in planned.values()) == [2, 2, 2]
    assert sorted(holders_of(planned)) == [f"t{i}" for i in range(6)]
    assert all(len(holders) == 1 for holders in holders_of(planned).values())
    # Heaviest first, each on the worker carrying the least weight: 6, 5, 4 then 3 on w3 (4), …
    assert planned == {"w1": ["t0", "t5"], "w2": ["t1", "t4"], "w3": ["t2", "t3"]}


def test_room_left_after_one_holder_each_goes_to_the_busiest_templates_first():
    workers = {"w1": Capacity(100 * MIB, 3), "w2": Capacity(100 * MIB, 3)}  # 6 pins, 4 templates
    holders = holders_of(plan(_demands(10, 5, 1, 1), workers))
    assert {name: len(h) for name, h in holders.items()} == {"t0": 2, "t1": 2, "t2": 1, "t3": 1}


def test_bytes_bound_a_worker_as_entries_do_and_a_template_that_fits_nowhere_has_no_holder():
    workers = {"w1": Capacity(3 * MIB, 10), "w2": Capacity(1 * MIB, 10)}
    demands = [Demand("big", 9.0, 3 * MIB), Demand("small", 1.0, MIB), Demand("huge", 5.0, 8 * MIB)]
    planned = plan(demands, workers)
    assert planned == {"w1": ["big"], "w2": ["small"]}
    assert "huge" not in holders_of(planned)


def test_the_same_inputs_give_the_same_plan_in_any_order():
    workers = {f"w{i}": Capacity(50 * MIB, 3) for i in range(4)}
    demands = [Demand(f"t{i}", float(i % 5), (1 + i % 3) * MIB) for i in range(20)]
    first = plan(demands, workers)
    for seed in range(5):
        shuffled = demands[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(shuffled, dict(sorted(workers.items(), reverse=True))) == first


def test_a_worker_leaving_moves_only_what_it_must_when_weights_are_equal():
    workers = {"w1": Capacity(100 * MIB, 2), "w2": Capacity(100 * MIB, 2)}
    both = plan(_demands(0, 0, 0, 0), workers)
    assert both == {"w1": ["t0", "t2"], "w2": ["t1", "t3"]}
    alone = plan(_demands(0, 0, 0, 0), {"w1": workers["w1"]})
    assert alone == {"w1": ["t0", "t1"]}


def test_weights_are_rounded_so_a_few_more_requests_do_not_move_pins():
    assert rounded(1234.0) == rounded(1240.0) == 1200.0
    assert rounded(0.0) == 0.0 and rounded(-1.0) == 0.0


def test_a_template_goes_only_to_workers_that_have_its_model():
    workers = {"w1": Capacity(100 * MIB, 2), "w2": Capacity(100 * MIB, 2)}
    demands = _demands(3, 2, 1)
    planned = plan(demands, workers, eligible={"t0": {"w2"}, "t1": {"w2"}, "t2": {"w1", "w2"}})
    assert planned == {"w1": ["t2"], "w2": ["t0", "t1"]}
