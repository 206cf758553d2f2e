"""Wire details shared by the SMB client and server (payload layouts, codes).

The native core (cython/smb_core.pyx) declares the same layouts as packed C
structs; tests/test_smb_protocol.py checks that both agree.

Control requests carry a JSON object, optionally followed by a NUL byte and a
binary tail (a packed remote key). Counters and vector ops use fixed binary
layouts that the native core parses without the GIL.
"""
import json
import struct

# dtype name -> code (0..3 are the vector kernels' codes)
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int64": 4, "uint8": 5}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "uint8": 1}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")

# reply status codes: UCS status values, so errors.from_ucs_status() maps them
STATUS_NO_MEMORY = -21   # UCS_ERR_EXCEEDS_LIMIT -> SMBMemoryError
STATUS_INVALID = -5      # UCS_ERR_INVALID_PARAM -> SMBValueError
STATUS_NO_ELEM = -12     # UCS_ERR_NO_ELEM -> SMBKeyError
STATUS_BOUNDS = -19      # UCS_ERR_OUT_OF_RANGE -> SMBBoundsError
STATUS_REJECTED = -23    # UCS_ERR_REJECTED -> SMBPermissionError

CONTROL_SEPARATOR = b"\0"

MAGIC = 0x534D4231                            # "SMB1"
HEADER = struct.Struct("<IHhIIQ")             # magic, op, status, payload length, reserved, request id
PUT_DESC = struct.Struct("<IIQ")              # region, counter +1 once landed (0: none), byte offset; data follows
GET_DESC = struct.Struct("<IIQQ")             # region, reserved, byte offset, bytes
COUNTER_REQUEST = struct.Struct("<IIQqq")     # region, kind, index, a, b
COUNTER_REPLY = struct.Struct("<q")
VEC_REQUEST = struct.Struct("<IIIIQQd")       # kind, nsrc, dst region, dst slot, start, count, alpha
VEC_SOURCE = struct.Struct("<IId")            # region, slot, weight
# segment ops (Adasum's VEC_DOT_NORMS, VEC_PAIR_SUM): two sources, then segments
VEC_SEGMENT = struct.Struct("<QQdd")          # start, count, weight of source a, of source b
DOT_NORMS_REPLY = struct.Struct("<ddd")       # per segment: a.b, a.a, b.b
MAX_VEC_SEGMENTS = 16384                      # segments per request (the server's limit)


def encode_control(obj, tail=b""):
    data = json.dumps(obj, separators=(",", ":")).encode()
    return data + CONTROL_SEPARATOR + tail if tail else data


def decode_control(payload):
    """(object, binary tail) of a control payload."""
    head, sep, tail = bytes(payload).partition(CONTROL_SEPARATOR)
    return json.loads(head), tail


def partition(length, num_servers):
    """Column ranges [(start, stop)] per server; a function of (length, num_servers) only."""
    return [(s * length // num_servers, (s + 1) * length // num_servers) for s in range(num_servers)]
