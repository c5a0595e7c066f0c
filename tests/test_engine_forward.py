"""engine/device/forward.build_pass: the one builder of a pass's ids, positions, slots and query
starts (hand-worked case from its docstring)."""

import torch

from vllm_triforce.engine.device.forward import build_pass


def test_build_pass_docstring_example():
    table = torch.tensor([[10, 11], [20, 21]], dtype=torch.int32)
    inputs = build_pass([[7, 8], [9]], [[5, 6], [2]], table, 4, [7, 3])
    assert inputs.input_ids.tolist() == [7, 8, 9] and inputs.input_ids.dtype == torch.int32
    assert inputs.positions.tolist() == [5, 6, 2]
    assert inputs.slot_mapping.tolist() == [45, 46, 82]  # 11*4+1, 11*4+2, 20*4+2
    assert inputs.query_start_loc == [0, 2, 3] and inputs.query_start_loc_dev.tolist() == [0, 2, 3]
    assert inputs.seq_lens == [7, 3] and inputs.seq_lens_dev.tolist() == [7, 3]
    assert inputs.sample_rows == [0, 1, 2] and inputs.sample_rows_dev.tolist() == [0, 1, 2]
    last = build_pass([[7, 8], [9]], [[5, 6], [2]], table, 4, [7, 3], sample_last=True)
    assert last.sample_rows == [1, 2] and last.sample_rows_dev.tolist() == [1, 2]


def test_build_pass_takes_device_ids_and_model_positions():
    """Ids already on the device (the small draft's proposals) are used as they are; the
    model rotates with `model_positions` while the slots follow the absolute positions."""
    table = torch.tensor([[10, 11], [20, 21]], dtype=torch.int32)
    inputs = build_pass(torch.tensor([7, 8, 9]), [[5, 6], [2]], table, 4, [7, 3],
                        model_positions=[[1, 2], [2]])
    assert inputs.input_ids.tolist() == [7, 8, 9] and inputs.input_ids.dtype == torch.int32
    assert inputs.positions.tolist() == [1, 2, 2]
    assert inputs.slot_mapping.tolist() == [45, 46, 82]
