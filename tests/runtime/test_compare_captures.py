"""compare_captures on hand-made captures: DSA selection differences and the rows that attend to a left-out row."""

import torch

from adapt.runtime.model import Capture, compare_captures


def _captures(ref_rows, other_rows, ref_sel, other_sel):
    """Two captures of one prefill step over layers 0 and 1 (hidden states [N, 4], DSA selections [N, 2])."""
    ref, other = Capture(dsa_indices=True), Capture(dsa_indices=True)
    for layer in (0, 1):
        ref.hidden_states[layer] = [ref_rows[layer]]
        other.hidden_states[layer] = [other_rows[layer]]
        ref.dsa_indices[layer] = [ref_sel[layer]]
        other.dsa_indices[layer] = [other_sel[layer]]
    return ref, other


def test_a_row_with_another_selection_is_counted_and_left_out():
    h = torch.ones(4, 4)
    far = h.clone()
    far[2] = 5.0  # row 2 attended elsewhere in layer 0: its activations diverge from there on
    sel = torch.tensor([[0, -1], [0, 1], [0, 1], [1, 2]], dtype=torch.int32)
    moved = sel.clone()
    moved[2] = torch.tensor([1, 0])  # the same set in another order: not a difference
    moved[3] = torch.tensor([0, 2])
    far[3] = 5.0
    ref, other = _captures({0: h, 1: h}, {0: far, 1: far}, {0: sel, 1: sel}, {0: moved, 1: moved})
    c = compare_captures(ref, other)
    assert c.dsa_flips == {0: 1, 1: 0}  # row 3, counted where it first differs
    assert c.layer_error[0] > 0.5  # row 2 kept the same set: its divergence counts
    sel_other = moved.clone()
    sel_other[2] = torch.tensor([0, 3])
    ref, other = _captures({0: h, 1: h}, {0: far, 1: far}, {0: sel, 1: sel}, {0: sel_other, 1: sel_other})
    c = compare_captures(ref, other)
    assert c.dsa_flips == {0: 2, 1: 0} and c.layer_error == {0: 0.0, 1: 0.0}
    assert c.agreeing_rows == {0: 0.5, 1: 0.5}


def test_later_rows_of_a_left_out_rows_sequence_are_left_out_from_the_next_layer():
    h = torch.ones(5, 4)
    sel = torch.tensor([[0, -1]] * 5, dtype=torch.int32)
    flip = sel.clone()
    flip[1] = torch.tensor([1, -1])  # row 1 (sequence 0) selects otherwise in layer 0
    out1 = h.clone()
    out1[2] = 3.0  # row 2 (sequence 0, after row 1) attends to row 1's diverged keys in layer 1
    seqs = [torch.tensor([0, 0, 0, 1, 1])]
    ref, other = _captures({0: h, 1: h}, {0: h, 1: out1}, {0: sel, 1: sel}, {0: flip, 1: sel})
    assert compare_captures(ref, other).layer_error[1] > 0.5  # without sequences row 2 counts
    c = compare_captures(ref, other, sequences=seqs)
    assert c.layer_error == {0: 0.0, 1: 0.0} and c.dsa_flips == {0: 1, 1: 0}
    assert [round(c.agreeing_rows[i], 6) for i in (0, 1)] == [0.8, 0.6]  # layer 1: rows 1 and 2 out, not sequence 1
    out1[4] = 3.0  # sequence 1 never left a row out: its rows still count
    ref, other = _captures({0: h, 1: h}, {0: h, 1: out1}, {0: sel, 1: sel}, {0: flip, 1: sel})
    assert compare_captures(ref, other, sequences=seqs).layer_error[1] > 0.5
