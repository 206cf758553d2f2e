# Declarations of libibverbs (rdma-core, <infiniband/verbs.h>) used by EDDIS.
# Pure declarations, no logic: the device query lives in verbs.pyx.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "<infiniband/verbs.h>" nogil:

    enum ibv_node_type:
        IBV_NODE_UNKNOWN
        IBV_NODE_CA
        IBV_NODE_SWITCH
        IBV_NODE_ROUTER
        IBV_NODE_RNIC
        IBV_NODE_USNIC
        IBV_NODE_USNIC_UDP
        IBV_NODE_UNSPECIFIED

    enum ibv_transport_type:
        IBV_TRANSPORT_UNKNOWN
        IBV_TRANSPORT_IB
        IBV_TRANSPORT_IWARP
        IBV_TRANSPORT_USNIC
        IBV_TRANSPORT_USNIC_UDP
        IBV_TRANSPORT_UNSPECIFIED

    enum ibv_port_state:
        IBV_PORT_NOP
        IBV_PORT_DOWN
        IBV_PORT_INIT
        IBV_PORT_ARMED
        IBV_PORT_ACTIVE
        IBV_PORT_ACTIVE_DEFER

    enum ibv_mtu:
        IBV_MTU_256
        IBV_MTU_512
        IBV_MTU_1024
        IBV_MTU_2048
        IBV_MTU_4096

    enum:
        IBV_LINK_LAYER_UNSPECIFIED
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET

    struct ibv_device:
        ibv_node_type node_type
        ibv_transport_type transport_type
        char name[64]
        char dev_name[64]
        char dev_path[256]
        char ibdev_path[256]

    struct ibv_context:
        ibv_device *device
        int num_comp_vectors

    struct ibv_device_attr:
        char fw_ver[64]
        uint64_t node_guid
        uint64_t sys_image_guid
        uint64_t max_mr_size
        uint64_t page_size_cap
        uint32_t vendor_id
        uint32_t vendor_part_id
        uint32_t hw_ver
        int max_qp
        int max_qp_wr
        unsigned int device_cap_flags
        int max_sge
        int max_cq
        int max_cqe
        int max_mr
        int max_pd
        uint8_t phys_port_cnt

    struct ibv_port_attr:
        ibv_port_state state
        ibv_mtu max_mtu
        ibv_mtu active_mtu
        int gid_tbl_len
        uint32_t port_cap_flags
        uint32_t max_msg_sz
        uint16_t lid
        uint16_t sm_lid
        uint8_t lmc
        uint8_t active_width
        uint8_t active_speed
        uint8_t phys_state
        uint8_t link_layer

    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **devices)
    const char *ibv_get_device_name(ibv_device *device)
    uint64_t ibv_get_device_guid(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *device_attr)
    int ibv_query_port(ibv_context *context, uint8_t port_num, ibv_port_attr *port_attr)
    const char *ibv_node_type_str(ibv_node_type node_type)
    const char *ibv_port_state_str(ibv_port_state port_state)
