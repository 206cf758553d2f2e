"""The wire protocol is declared twice, as packed C structs in the native core and as
struct layouts in eddis.smb.protocol; they must agree, byte for byte."""
from eddis.smb import _core, protocol


def test_every_layout_has_the_native_size():
    python_side = {"header": protocol.HEADER, "counter_request": protocol.COUNTER_REQUEST,
                   "vec_request": protocol.VEC_REQUEST, "vec_source": protocol.VEC_SOURCE,
                   "vec_segment": protocol.VEC_SEGMENT,
                   "put_desc": protocol.PUT_DESC, "get_desc": protocol.GET_DESC}
    assert set(python_side) == set(_core.WIRE_SIZES)
    assert {name: layout.size for name, layout in python_side.items()} == _core.WIRE_SIZES
    assert protocol.MAX_VEC_SEGMENTS == _core.WIRE_MAX_VEC_SEGMENTS


def test_magic_and_status_codes_agree():
    assert protocol.MAGIC == _core.WIRE_MAGIC
    assert {"no_memory": protocol.STATUS_NO_MEMORY, "invalid": protocol.STATUS_INVALID,
            "no_elem": protocol.STATUS_NO_ELEM, "bounds": protocol.STATUS_BOUNDS,
            "rejected": protocol.STATUS_REJECTED} == _core.WIRE_STATUS


def test_dtype_codes_agree():
    assert protocol.DTYPES == _core.DTYPE_CODES
    assert {protocol.DTYPES[name]: size for name, size in protocol.ITEMSIZE.items()} == _core.ITEMSIZES
