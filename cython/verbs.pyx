# cython: language_level=3
"""InfiniBand device discovery through libibverbs (extension ``eddis._verbs``).

``query()`` lists the HCAs of this host with their ports, port state, link
layer and link rate. A host without RDMA hardware is a *finding*, not an
error: with no kernel RDMA core ``ibv_get_device_list`` returns NULL with
errno ENOSYS (not an empty list), and ``query()`` reports that as
``{"devices": [], "finding": "no HCA found (...)"}``.
Any other failure raises an :mod:`eddis.errors` exception carrying the errno.
"""
from libc.errno cimport errno, ENOSYS, ENODEV, ENOENT, ENXIO
from libc.stdint cimport uint64_t
from libc.string cimport memset, strerror

from libibverbs cimport *

from eddis.errors import from_errno

cdef extern from "<endian.h>" nogil:
    uint64_t be64toh(uint64_t)

# errno values of ibv_get_device_list that mean "this host has no usable HCA".
NO_HCA_ERRNOS = {ENOSYS: "the kernel has no RDMA core (no ib_uverbs)",
                 ENODEV: "no RDMA device",
                 ENOENT: "no RDMA device node under /dev/infiniband",
                 ENXIO: "no RDMA device"}

# IB port attribute codes (IBTA spec; same tables as ibv_devinfo/ibstat).
LINK_WIDTH_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
LINK_SPEED_GBPS_PER_LANE = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0,
                            64: 50.0, 128: 100.0}
LINK_SPEED_NAME = {1: "SDR", 2: "DDR", 4: "QDR", 8: "FDR10", 16: "FDR", 32: "EDR",
                   64: "HDR", 128: "NDR"}
LINK_LAYER_NAME = {IBV_LINK_LAYER_UNSPECIFIED: "unspecified",
                   IBV_LINK_LAYER_INFINIBAND: "InfiniBand",
                   IBV_LINK_LAYER_ETHERNET: "Ethernet"}
MTU_BYTES = {IBV_MTU_256: 256, IBV_MTU_512: 512, IBV_MTU_1024: 1024,
             IBV_MTU_2048: 2048, IBV_MTU_4096: 4096}


def link_rate_gbps(int width_code, int speed_code):
    """Port data rate in Gb/s from ``active_width`` and ``active_speed`` codes.

    Returns None when either code is unknown (a port that is down reports 0).
    """
    lanes = LINK_WIDTH_LANES.get(width_code)
    per_lane = LINK_SPEED_GBPS_PER_LANE.get(speed_code)
    if lanes is None or per_lane is None:
        return None
    return lanes * per_lane


cdef object _errno_error(int err, str what):
    return from_errno(err, f"{what} failed: {strerror(err).decode()}")


cdef int CHKERR(int err, const char *what) except -1 nogil:
    """Raise the eddis.errors exception for a verbs call that returned an errno."""
    if err == 0:
        return 0
    with gil:
        raise _errno_error(err, what.decode())


cdef str _text(const char *s):
    return s.decode("utf-8", "replace") if s != NULL else ""


cdef str _guid(uint64_t be_guid):
    cdef uint64_t g = be64toh(be_guid)
    h = f"{g:016x}"
    return ":".join(h[i:i + 4] for i in range(0, 16, 4))


cdef dict _port(ibv_context *ctx, int port_num):
    cdef ibv_port_attr attr
    memset(&attr, 0, sizeof(attr))
    with nogil:
        CHKERR(ibv_query_port(ctx, <uint8_t>port_num, &attr), "ibv_query_port")
    return {
        "port": port_num,
        "state": _text(ibv_port_state_str(attr.state)),
        "active": attr.state == IBV_PORT_ACTIVE,
        "link_layer": LINK_LAYER_NAME.get(attr.link_layer, str(attr.link_layer)),
        "lid": attr.lid,
        "active_mtu": MTU_BYTES.get(attr.active_mtu),
        "width": f"{LINK_WIDTH_LANES[attr.active_width]}x"
                 if attr.active_width in LINK_WIDTH_LANES else None,
        "speed": LINK_SPEED_NAME.get(attr.active_speed),
        "rate_gbps": link_rate_gbps(attr.active_width, attr.active_speed),
    }


cdef dict _device(ibv_device *dev):
    cdef ibv_context *ctx
    cdef ibv_device_attr attr
    cdef int err = 0
    info = {
        "name": _text(ibv_get_device_name(dev)),
        "guid": _guid(ibv_get_device_guid(dev)),
        "node_type": _text(ibv_node_type_str(dev.node_type)),
        "ports": [],
    }
    with nogil:
        ctx = ibv_open_device(dev)
        if ctx == NULL:
            err = errno
    if ctx == NULL:
        # A device we may not open (permissions, driver) is reported, not fatal.
        info["error"] = str(_errno_error(err or ENODEV, "ibv_open_device"))
        return info
    try:
        memset(&attr, 0, sizeof(attr))
        with nogil:
            CHKERR(ibv_query_device(ctx, &attr), "ibv_query_device")
        info["fw_ver"] = _text(attr.fw_ver)
        info["vendor_id"] = attr.vendor_id
        info["vendor_part_id"] = attr.vendor_part_id
        info["ports"] = [_port(ctx, p) for p in range(1, attr.phys_port_cnt + 1)]
    finally:
        with nogil:
            ibv_close_device(ctx)
    return info


def query():
    """All HCAs of this host: ``{"devices": [...], "finding": str or None}``.

    Each device: name, guid, node_type, fw_ver, vendor ids, and ports with
    state, active flag, link layer, lid, MTU, width, speed and rate_gbps.
    """
    cdef int num = 0
    cdef int err = 0
    cdef ibv_device **devs
    with nogil:
        devs = ibv_get_device_list(&num)
        if devs == NULL:
            err = errno
    if devs == NULL:
        if err in NO_HCA_ERRNOS or err == 0:
            why = NO_HCA_ERRNOS.get(err, "no RDMA device")
            name = {ENOSYS: "ENOSYS", ENODEV: "ENODEV", ENOENT: "ENOENT", ENXIO: "ENXIO"}.get(err, str(err))
            return {"devices": [],
                    "finding": f"no HCA found: ibv_get_device_list returned NULL with {name} ({why})"}
        raise _errno_error(err, "ibv_get_device_list")
    try:
        devices = [_device(devs[i]) for i in range(num)]
    finally:
        ibv_free_device_list(devs)
    return {"devices": devices, "finding": None if devices else "no HCA found: no RDMA device listed"}
