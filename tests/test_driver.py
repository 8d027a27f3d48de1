"""kernels.driver: the launch structures as the CUDA driver's header lays them out, and a kept launch's words (no GPU
needed: nothing here calls the driver)."""
import ctypes

import pytest
import torch

from sparsekit.kernels import driver


def test_launch_structures_have_the_driver_headers_layout():
    # CUlaunchConfig: 7 x u32, the stream pointer at 32, attrs at 40, numAttrs at 48 -> 56 bytes;
    # CUlaunchAttribute: u32 id, 4 bytes of padding, a 64-byte value union -> 72 bytes
    assert ctypes.sizeof(driver.LaunchConfig) == 56 and driver.LaunchConfig.stream.offset == 32
    assert driver.LaunchConfig.attrs.offset == 40 and driver.LaunchConfig.num_attrs.offset == 48
    assert ctypes.sizeof(driver.LaunchAttribute) == 72 and driver.LaunchAttribute.value.offset == 8


def test_packed_keeps_one_buffer_of_words_the_driver_reads_whole():
    p = driver.Packed(0x1234, 8, 128, 4096, 5, cluster=2)
    p.words[:] = [0, 0, 7, 2, -1]             # an int64 of -1 is the word 2^64 - 1
    extra = [p.extra[i] or 0 for i in range(5)]
    assert extra == [driver.CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(p.words),
                     driver.CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(p.size), driver.CU_LAUNCH_PARAM_END]
    assert p.size.value == 40 and p.words[4] == 2 ** 64 - 1
    c = p.config
    assert (c.grid_x, c.block_x, c.shared_bytes, c.num_attrs) == (8, 128, 4096, 1)   # the grid counts blocks
    assert c.attrs[0].id == driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION and list(c.attrs[0].value[:3]) == [2, 1, 1]
    q = p.copy()
    q.words[2] = 9                             # a copy's words are its own
    assert p.words[2] == 7 and list(q.words) == [0, 0, 9, 2, 2 ** 64 - 1]
    assert ctypes.addressof(q.words) != ctypes.addressof(p.words) and q.extra[1] == ctypes.addressof(q.words)
    assert (q.config.grid_x, q.config.block_x, q.config.shared_bytes, q.config.num_attrs) == (8, 128, 4096, 1)
    assert q.func.value == 0x1234
    one = driver.Packed(0x1234, 3, 32, 0, 0)
    assert one.config.num_attrs == 0 and not one.config.attrs and one.size.value == 0


def test_packed_refuses_blocks_that_do_not_make_whole_clusters():
    with pytest.raises(ValueError, match="clusters of 4"):
        driver.Packed(1, 6, 128, 0, 3, cluster=4)
    with pytest.raises(ValueError):
        driver.Packed(1, 0, 128, 0, 3)


def test_a_kept_launch_is_replayed_only_for_a_plain_fp16_x(monkeypatch):
    """``launch.replay`` writes X's address into a kept launch's words: only for a contiguous, 16-byte aligned fp16
    X (what the launch was recorded with), else it declines (the caller's full path pads or copies)."""
    from sparsekit.kernels import launch

    monkeypatch.setattr(launch, "planned", {("k",): (None, 32, 39, 0, ())})
    x = torch.zeros(4, 72, dtype=torch.float16)
    assert launch.replay(("other",), x, 8) is None                      # nothing kept for that key
    assert launch.replay(("k",), x.float(), 8) is None                  # another dtype
    assert launch.replay(("k",), x[:, :64], 8) is None                  # not contiguous
    assert launch.replay(("k",), x.view(-1)[1:257].view(4, 64), 8) is None   # 2 bytes off a 16-byte boundary


def test_kept_launches_go_with_the_kernel_caches_and_the_kernel_choice(monkeypatch):
    """A kept launch holds the tensors whose addresses it carries: ``release_kernel_caches`` (after weights are
    replaced or freed) drops them, and so does ``reset_kernel_choice`` (they were made under the old choice)."""
    from sparsekit.kernels import launch, matmul
    from sparsekit.runtime.sparse_linear import release_kernel_caches

    monkeypatch.setattr(launch, "planned", {})
    launch.planned[("k",)] = (None, 32, 39, 0, (torch.zeros(1),))
    release_kernel_caches()
    assert not launch.planned
    launch.planned[("k",)] = (None, 32, 39, 0, ())
    matmul.reset_kernel_choice()
    assert not launch.planned


def test_raw_stream_takes_torchs_handle_without_a_stream_object(monkeypatch):
    """``torch_compat.raw_stream``: the private handle getter where torch has it (the device's index passed), the
    public ``current_stream(device).cuda_stream`` where it does not."""
    from types import SimpleNamespace

    from sparsekit import torch_compat

    seen = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: seen.append(i) or 1234, raising=False)
    assert torch_compat.raw_stream(torch.device("cuda", 3)) == 1234 and seen == [3]
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: SimpleNamespace(cuda_stream=5678))
    assert torch_compat.raw_stream(torch.device("cuda", 0)) == 5678
