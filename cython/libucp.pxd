# Declarations of the parts of UCX (UCP API, UCS status) that EDDIS uses.
# Pure declarations, no logic; field lists are partial (Cython only needs the
# members we touch). Mirrors <ucp/api/ucp.h> of UCX 1.13.
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.stdio cimport FILE


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned socklen_t
    struct sockaddr:
        pass
    struct sockaddr_storage:
        pass


cdef extern from "<ucs/type/status.h>" nogil:
    ctypedef int ucs_status_t
    ctypedef void *ucs_status_ptr_t
    enum:
        UCS_OK
        UCS_INPROGRESS
        UCS_ERR_NO_MESSAGE
        UCS_ERR_NO_RESOURCE
        UCS_ERR_IO_ERROR
        UCS_ERR_NO_MEMORY
        UCS_ERR_INVALID_PARAM
        UCS_ERR_UNREACHABLE
        UCS_ERR_NO_ELEM
        UCS_ERR_BUSY
        UCS_ERR_CANCELED
        UCS_ERR_ALREADY_EXISTS
        UCS_ERR_OUT_OF_RANGE
        UCS_ERR_TIMED_OUT
        UCS_ERR_EXCEEDS_LIMIT
        UCS_ERR_UNSUPPORTED
        UCS_ERR_REJECTED
        UCS_ERR_NOT_CONNECTED
        UCS_ERR_CONNECTION_RESET
        UCS_ERR_ENDPOINT_TIMEOUT
    const char *ucs_status_string(ucs_status_t status)
    bint UCS_PTR_IS_ERR(ucs_status_ptr_t ptr)
    bint UCS_PTR_IS_PTR(ucs_status_ptr_t ptr)
    ucs_status_t UCS_PTR_STATUS(ucs_status_ptr_t ptr)


cdef extern from "<ucs/type/thread_mode.h>" nogil:
    ctypedef enum ucs_thread_mode_t:
        UCS_THREAD_MODE_SINGLE
        UCS_THREAD_MODE_SERIALIZED
        UCS_THREAD_MODE_MULTI


cdef extern from "<ucp/api/ucp.h>" nogil:
    ctypedef struct ucp_context:
        pass
    ctypedef ucp_context *ucp_context_h
    ctypedef struct ucp_worker:
        pass
    ctypedef ucp_worker *ucp_worker_h
    ctypedef struct ucp_ep:
        pass
    ctypedef ucp_ep *ucp_ep_h
    ctypedef struct ucp_listener:
        pass
    ctypedef ucp_listener *ucp_listener_h
    ctypedef struct ucp_conn_request:
        pass
    ctypedef ucp_conn_request *ucp_conn_request_h
    ctypedef struct ucp_mem:
        pass
    ctypedef ucp_mem *ucp_mem_h
    ctypedef struct ucp_rkey:
        pass
    ctypedef ucp_rkey *ucp_rkey_h
    ctypedef struct ucp_config_t:
        pass

    # features and field masks
    enum:
        UCP_PARAM_FIELD_FEATURES
        UCP_FEATURE_RMA
        UCP_FEATURE_AMO64
        UCP_FEATURE_WAKEUP
        UCP_FEATURE_AM
        UCP_WORKER_PARAM_FIELD_THREAD_MODE
        UCP_LISTENER_PARAM_FIELD_SOCK_ADDR
        UCP_LISTENER_PARAM_FIELD_CONN_HANDLER
        UCP_LISTENER_ATTR_FIELD_SOCKADDR
        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        UCP_EP_PARAM_FIELD_ERR_HANDLER
        UCP_EP_PARAM_FIELD_USER_DATA
        UCP_EP_PARAM_FIELD_SOCK_ADDR
        UCP_EP_PARAM_FIELD_FLAGS
        UCP_EP_PARAM_FIELD_CONN_REQUEST
        UCP_EP_PARAMS_FLAGS_CLIENT_SERVER
        UCP_EP_CLOSE_FLAG_FORCE
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS
        UCP_MEM_MAP_PARAM_FIELD_LENGTH
        UCP_MEM_MAP_PARAM_FIELD_FLAGS
        UCP_AM_HANDLER_PARAM_FIELD_ID
        UCP_AM_HANDLER_PARAM_FIELD_FLAGS
        UCP_AM_HANDLER_PARAM_FIELD_CB
        UCP_AM_HANDLER_PARAM_FIELD_ARG
        UCP_AM_FLAG_WHOLE_MSG
        UCP_AM_SEND_FLAG_REPLY
        UCP_AM_SEND_FLAG_EAGER
        UCP_AM_RECV_ATTR_FIELD_REPLY_EP
        UCP_AM_RECV_ATTR_FLAG_DATA
        UCP_AM_RECV_ATTR_FLAG_RNDV
        UCP_OP_ATTR_FIELD_CALLBACK
        UCP_OP_ATTR_FIELD_USER_DATA
        UCP_OP_ATTR_FIELD_FLAGS
        UCP_OP_ATTR_FLAG_NO_IMM_CMPL

    ctypedef enum ucp_err_handling_mode_t:
        UCP_ERR_HANDLING_MODE_NONE
        UCP_ERR_HANDLING_MODE_PEER

    ctypedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status)
    ctypedef void (*ucp_listener_conn_callback_t)(ucp_conn_request_h conn_request, void *arg)
    ctypedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data)

    ctypedef struct ucp_am_recv_param_t:
        uint64_t recv_attr
        ucp_ep_h reply_ep
    ctypedef ucs_status_t (*ucp_am_recv_callback_t)(void *arg, const void *header,
                                                   size_t header_length, void *data,
                                                   size_t length,
                                                   const ucp_am_recv_param_t *param)

    ctypedef struct ucp_params_t:
        uint64_t field_mask
        uint64_t features

    ctypedef struct ucp_worker_params_t:
        uint64_t field_mask
        ucs_thread_mode_t thread_mode

    ctypedef struct ucs_sock_addr_t:
        const sockaddr *addr
        socklen_t addrlen

    ctypedef struct ucp_listener_conn_handler_t:
        ucp_listener_conn_callback_t cb
        void *arg

    ctypedef struct ucp_listener_params_t:
        uint64_t field_mask
        ucs_sock_addr_t sockaddr
        ucp_listener_conn_handler_t conn_handler

    ctypedef struct ucp_listener_attr_t:
        uint64_t field_mask
        sockaddr_storage sockaddr

    ctypedef struct ucp_err_handler_t:
        ucp_err_handler_cb_t cb
        void *arg

    ctypedef struct ucp_ep_params_t:
        uint64_t field_mask
        ucp_err_handling_mode_t err_mode
        ucp_err_handler_t err_handler
        void *user_data
        unsigned flags
        ucs_sock_addr_t sockaddr
        ucp_conn_request_h conn_request

    ctypedef struct ucp_mem_map_params_t:
        uint64_t field_mask
        void *address
        size_t length
        unsigned flags

    ctypedef struct ucp_am_handler_param_t:
        uint64_t field_mask
        unsigned id
        uint32_t flags
        ucp_am_recv_callback_t cb
        void *arg

    ctypedef union ucp_request_param_cb_t:
        ucp_send_nbx_callback_t send

    ctypedef struct ucp_request_param_t:
        uint32_t op_attr_mask
        uint32_t flags
        ucp_request_param_cb_t cb
        void *user_data

    # context and worker
    ucs_status_t ucp_config_read(const char *env_prefix, const char *filename,
                                 ucp_config_t **config_p)
    void ucp_config_release(ucp_config_t *config)
    ucs_status_t ucp_init(const ucp_params_t *params, const ucp_config_t *config,
                          ucp_context_h *context_p)
    void ucp_cleanup(ucp_context_h context)
    void ucp_context_print_info(const ucp_context_h context, FILE *stream)
    const char *ucp_get_version_string()
    ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
                                   ucp_worker_h *worker_p)
    void ucp_worker_destroy(ucp_worker_h worker)
    unsigned ucp_worker_progress(ucp_worker_h worker)
    ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd)
    ucs_status_t ucp_worker_arm(ucp_worker_h worker)
    ucs_status_t ucp_worker_signal(ucp_worker_h worker)
    ucs_status_t ucp_worker_set_am_recv_handler(ucp_worker_h worker,
                                                const ucp_am_handler_param_t *param)

    # listener and endpoints
    ucs_status_t ucp_listener_create(ucp_worker_h worker, const ucp_listener_params_t *params,
                                     ucp_listener_h *listener_p)
    void ucp_listener_destroy(ucp_listener_h listener)
    ucs_status_t ucp_listener_query(ucp_listener_h listener, ucp_listener_attr_t *attr)
    ucs_status_t ucp_listener_reject(ucp_listener_h listener, ucp_conn_request_h conn_request)
    ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params,
                               ucp_ep_h *ep_p)
    ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param)
    ucs_status_ptr_t ucp_ep_flush_nbx(ucp_ep_h ep, const ucp_request_param_t *param)

    # memory
    ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params,
                             ucp_mem_h *memh_p)
    ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh)
    ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh,
                               void **rkey_buffer_p, size_t *size_p)
    void ucp_rkey_buffer_release(void *rkey_buffer)
    ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p)
    void ucp_rkey_destroy(ucp_rkey_h rkey)

    # communication
    ucs_status_ptr_t ucp_am_send_nbx(ucp_ep_h ep, unsigned id, const void *header,
                                     size_t header_length, const void *buffer, size_t count,
                                     const ucp_request_param_t *param)
    ucs_status_ptr_t ucp_put_nbx(ucp_ep_h ep, const void *buffer, size_t count,
                                 uint64_t remote_addr, ucp_rkey_h rkey,
                                 const ucp_request_param_t *param)
    ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count,
                                 uint64_t remote_addr, ucp_rkey_h rkey,
                                 const ucp_request_param_t *param)
    ucs_status_t ucp_request_check_status(void *request)
    void ucp_request_cancel(ucp_worker_h worker, void *request)
    void ucp_request_free(void *request)
