"""``kernels.gpu_facts``: a GPU's memory bandwidth from its memory clock and bus width, and which plans it takes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparsekit.kernels import gpu_facts


@pytest.fixture
def gpu(monkeypatch):
    """A pretend GPU per device index: ``gpu[i] = (memory clock kHz, bus bits, name)``."""
    table: dict = {}
    monkeypatch.delenv("SPARSEKIT_FAST_MEMORY", raising=False)
    monkeypatch.setattr(gpu_facts, "SIM", False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(
        memory_clock_rate=table[d.index][0], memory_bus_width=table[d.index][1]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: table[d.index][2])
    return table


def test_bandwidth_is_double_data_rate_over_the_bus_and_decides_fast_memory(gpu):
    gpu[11] = (3_201_000, 6144, "NVIDIA H200")              # 4.92 TB/s
    gpu[12] = (2_619_000, 5120, "NVIDIA H100 80GB HBM3")    # 3.35 TB/s
    h200, h100 = torch.device("cuda", 11), torch.device("cuda", 12)
    assert gpu_facts.bandwidth_gbps(h200) == pytest.approx(4917.0, abs=1)
    assert gpu_facts.bandwidth_gbps(h100) == pytest.approx(3352.3, abs=1)
    assert gpu_facts.fast_memory(h200) and not gpu_facts.fast_memory(h100)


def test_without_a_reported_memory_clock_the_name_decides(gpu):
    gpu[13] = (0, 0, "NVIDIA H200")
    gpu[14] = (0, 6144, "NVIDIA H100 80GB HBM3")
    assert gpu_facts.bandwidth_gbps(torch.device("cuda", 13)) == 0
    assert gpu_facts.fast_memory(torch.device("cuda", 13))
    assert not gpu_facts.fast_memory(torch.device("cuda", 14))


def test_the_simulator_plans_as_on_the_h100(monkeypatch):
    monkeypatch.delenv("SPARSEKIT_FAST_MEMORY", raising=False)
    monkeypatch.setattr(gpu_facts, "SIM", True)
    assert gpu_facts.bandwidth_gbps(torch.device("cuda", 15)) == 0
    assert not gpu_facts.fast_memory(torch.device("cuda", 15))


def test_the_environment_sets_the_choice_on_any_gpu_and_refuses_other_values(gpu, monkeypatch):
    gpu[16] = (2_619_000, 5120, "NVIDIA H100 80GB HBM3")
    h100 = torch.device("cuda", 16)
    monkeypatch.setenv("SPARSEKIT_FAST_MEMORY", "1")
    assert gpu_facts.fast_memory(h100)
    monkeypatch.setenv("SPARSEKIT_FAST_MEMORY", "0")
    gpu[17] = (3_201_000, 6144, "NVIDIA H200")
    assert not gpu_facts.fast_memory(torch.device("cuda", 17))
    monkeypatch.setenv("SPARSEKIT_FAST_MEMORY", "yes")
    with pytest.raises(ValueError, match="SPARSEKIT_FAST_MEMORY takes 1"):
        gpu_facts.fast_memory(h100)
    monkeypatch.delenv("SPARSEKIT_FAST_MEMORY")
    assert not gpu_facts.fast_memory(h100)
