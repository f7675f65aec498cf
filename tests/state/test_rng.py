"""RNG states as JSON (:mod:`flashckpt.state.rng`): a restored state draws what the captured one
would have drawn, and a damaged one (it comes from storage or shared memory) raises naming the part
and sets nothing."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from flashckpt.state.rng import capture_rng, restore_rng


def _draws() -> tuple[float, torch.Tensor, float, float]:
    return random.random(), torch.rand(4), float(np.random.rand()), float(np.random.randn())


def test_a_restored_state_draws_what_the_captured_one_would_have() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    np.random.randn()  # numpy holds a cached gauss now: has_gauss = 1 travels too
    saved = json.loads(json.dumps(capture_rng()))  # through JSON, as it is stored
    first = _draws()
    _draws()
    restore_rng(saved)
    again = _draws()
    assert first[0] == again[0] and first[2:] == again[2:]
    assert torch.equal(first[1], again[1])


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def damage(state: dict[str, Any]) -> None:
        node: Any = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return damage


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.pop(key)


DAMAGE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "torch missing": (_drop("torch"), "torch"),
    "torch not base64": (_set(("torch",), "@@@@"), "torch is not base64"),
    "torch short": (_set(("torch",), "AAAA"), "torch holds 3 bytes"),
    "python missing": (_drop("python"), "python is not"),
    "python short words": (_set(("python", 1), [1, 2, 3]), "python's words has 3 words"),
    "python word too big": (_set(("python", 1, 5), 1 << 40), "32-bit unsigned"),
    "python word a string": (_set(("python", 1, 5), "7"), "32-bit unsigned"),
    "python position": (_set(("python", 1, 624), 9999), "position 9999"),
    "python version": (_set(("python", 0), 2), "python's version is 2"),
    "python gauss": (_set(("python", 2), "x"), "python's gauss"),
    "numpy generator": (_set(("numpy", "bit_generator"), "PCG64"), "MT19937"),
    "numpy key": (_set(("numpy", "key"), list(range(10))), "numpy's key has 10 words"),
    "numpy pos": (_set(("numpy", "pos"), -1), "numpy's position"),
    "numpy has_gauss": (_set(("numpy", "has_gauss"), 2), "has_gauss"),
    "numpy gauss": (_set(("numpy", "gauss"), float("nan")), "numpy's gauss"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_state_raises_naming_the_part_and_sets_nothing(case: str) -> None:
    damage, words = DAMAGE[case]
    saved = json.loads(json.dumps(capture_rng()))
    bad = copy.deepcopy(saved)
    damage(bad)
    before = capture_rng()
    with pytest.raises(ValueError, match="RNG state is damaged") as info:
        restore_rng(bad)
    assert words in str(info.value), str(info.value)
    assert "Restore another step" in str(info.value)
    assert capture_rng() == before  # no generator was touched


def test_a_state_that_is_not_an_object_raises() -> None:
    with pytest.raises(ValueError, match="is a list, not a JSON object"):
        restore_rng([1, 2])
