"""eddis.core.comm.negotiate without MPI: what the ranks conclude from one round of announcements
(the decision is a pure function of every rank's Call, which is why every rank draws the
same one), and the fixed-size slot a Call travels in."""
import numpy as np
import pytest

from eddis.core.comm import negotiate
from eddis.core.comm.negotiate import Call, decide
from eddis.errors import ConfigError, UsageError

JOINED = Call(negotiate.JOINED, key=(3, 7))


def allreduce(dtype="float32", shape=(4,), op="average", name="loss", factors=(1.0, 1.0)):
    wire = "<f8" if dtype.startswith(("float", "bfloat")) else np.dtype(dtype).str
    return Call("allreduce", name=name, dtype=dtype, wire=wire, shape=shape, op=op, factors=factors)


def test_a_call_survives_its_slot_and_long_texts_are_cut():
    call = allreduce("bfloat16", shape=(2 ** 40,) * 8, name="x" * 500, factors=(0.1, 1 / 3))
    slot = call.encode()
    assert len(slot) == negotiate.SLOT
    back = Call.decode(slot)
    assert back == call and len(back.name) == negotiate.NAME_CHARS and back.what.startswith("eddis.allreduce(")
    invalid = Call(negotiate.INVALID, name="y" * 500, message="why " * 500)
    assert Call.decode(invalid.encode()) == invalid and len(invalid.message) == negotiate.MESSAGE_CHARS


def test_a_call_too_large_for_its_slot_becomes_an_error_on_every_rank():
    huge = Call("allreduce", name="t", dtype="float32", wire="<f8", shape=tuple(range(70000, 70300)), op="sum",
                factors=(1.0, 1.0))
    back = Call.decode(huge.encode())
    assert back.kind == negotiate.INVALID
    outcome = decide([back, allreduce(shape=tuple(range(70000, 70300)))])
    assert isinstance(outcome.error, ConfigError) and "rank 0" in str(outcome.error)
    assert "reshape it to fewer" in str(outcome.error)


def test_matching_calls_run():
    outcome = decide([allreduce(), allreduce(), allreduce()])
    assert outcome.error is None and outcome.callers == [0, 1, 2] and not outcome.joined


@pytest.mark.parametrize("other,words", [
    (Call("broadcast", name="loss", dtype="float32", shape=(4,), root=0), "rank 1 called eddis.broadcast(loss)"),
    (allreduce(name="accuracy"), "rank 1 called eddis.allreduce(accuracy)"),
])
def test_different_calls_are_refused_naming_both(other, words):
    outcome = decide([allreduce(), other])
    assert isinstance(outcome.error, UsageError)
    assert "rank 0 called eddis.allreduce(loss)" in str(outcome.error) and words in str(outcome.error)


def test_unnamed_calls_pair_by_order():
    assert decide([allreduce(name=None), allreduce(name="loss")]).error is None


@pytest.mark.parametrize("other,label", [
    (allreduce(dtype="float64"), "dtype"),
    (allreduce(shape=(5,)), "shape"),
    (allreduce(op="sum"), "op"),
    (allreduce(factors=(2.0, 1.0)), "scale factors"),
])
def test_allreduce_arguments_must_agree(other, label):
    error = decide([allreduce(), allreduce(), other]).error
    assert isinstance(error, ConfigError) and f"the {label}" in str(error) and "rank 2 has" in str(error)


def test_allgather_may_differ_in_its_first_dimension_only():
    def gather(shape):
        return Call("allgather", dtype="float32", shape=shape)
    assert decide([gather((1, 3)), gather((4, 3))]).error is None
    assert "after the first dimension" in str(decide([gather((1, 3)), gather((1, 2))]).error)
    assert "number of dimensions" in str(decide([gather((1, 3)), gather((3,))]).error)
    assert "reshape(1)" in str(decide([gather(()), gather(())]).error)


def test_a_root_rank_must_exist_and_agree():
    def bcast(root):
        return Call("broadcast_object", root=root, nbytes=9)
    assert "root rank differs" in str(decide([bcast(0), bcast(1)]).error)
    assert "does not exist" in str(decide([bcast(2), bcast(2)]).error)


def test_the_numeric_rules_of_allreduce_hold_on_every_rank():
    assert "would have to round" in str(decide([allreduce("int64"), allreduce("int64")]).error)
    assert "would have to round" in str(decide([allreduce("int32", op="sum", factors=(2.0, 1.0))] * 2).error)
    assert decide([allreduce("int64", op="sum")] * 2).error is None
    assert "integer tensor" in str(decide([allreduce("int64", op="adasum")] * 2).error)
    assert "power-of-2" in str(decide([allreduce(op="adasum")] * 3).error)
    assert decide([allreduce("bfloat16", op="adasum")] * 2).error is None


def test_beside_a_joined_rank_allreduce_and_barrier_run():
    outcome = decide([JOINED, allreduce(), allreduce()])
    assert outcome.error is None and outcome.joined == [0] and outcome.callers == [1, 2]
    assert outcome.first == allreduce()
    assert decide([Call("barrier"), JOINED]).error is None


@pytest.mark.parametrize("call", [
    Call("allgather", dtype="float32", shape=(2,)),
    Call("broadcast", dtype="float32", shape=(2,), root=1),
    Call("broadcast_object", root=1, nbytes=4),
    Call("allgather_object", nbytes=4),
    Call("broadcast_parameters", root=1),
])
def test_beside_a_joined_rank_other_collectives_are_refused_naming_it(call):
    error = decide([JOINED, call]).error
    assert isinstance(error, UsageError) and isinstance(error, RuntimeError)
    assert "rank(s) [0] called eddis.join()" in str(error) and "after join() returned" in str(error)


def test_the_join_refusal_comes_before_a_mismatch_of_roots():
    # Horovod reports "not supported with Join" first; its join test calls broadcast with
    # a different root on each training rank and expects that error
    error = decide([JOINED, Call("broadcast", dtype="float32", shape=(2,), root=1),
                    Call("broadcast", dtype="float32", shape=(2,), root=2)]).error
    assert isinstance(error, UsageError) and "eddis.join()" in str(error)


def test_a_round_in_which_every_rank_joined_ends_join():
    outcome = decide([Call(negotiate.JOINED, key=(2, 5)), Call(negotiate.JOINED, key=(4, 1))])
    assert outcome.all_joined and outcome.error is None
    assert [c.key for c in outcome.calls] == [(2, 5), (4, 1)]


@pytest.mark.parametrize("op,dtype,value", [
    ("sum", "<f8", 0.0), ("average", "<f8", 0.0), ("adasum", "<f8", 0.0), ("sum", "<i8", 0),
    ("min", "<f8", np.inf), ("max", "<f8", -np.inf),
    ("min", "<i4", np.iinfo(np.int32).max), ("max", "<i8", np.iinfo(np.int64).min),
])
def test_a_joined_rank_contributes_the_identity_of_the_op(op, dtype, value):
    call = Call("allreduce", dtype="x", wire=dtype, shape=(2, 3), op=op, factors=(1.0, 1.0))
    part = negotiate.identity(call)
    assert part.dtype == np.dtype(dtype) and part.shape == (6,)
    assert (part == value).all()
