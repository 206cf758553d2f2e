# Declarations of the parts of UCX (UCP API, UCS status) that EDDIS uses.
# Pure declarations, no logic; field lists are partial (Cython only needs the
# members we touch). Mirrors <ucp/api/ucp.h> of UCX 1.13.
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.stdio cimport FILE


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


cdef extern from "<ucs/config/types.h>" nogil:
    ctypedef enum ucs_config_print_flags_t:
        UCS_CONFIG_PRINT_CONFIG


cdef extern from "<ucs/memory/memory_type.h>" nogil:
    ctypedef enum ucs_memory_type_t:
        UCS_MEMORY_TYPE_HOST
        UCS_MEMORY_TYPE_CUDA
        UCS_MEMORY_TYPE_CUDA_MANAGED
        UCS_MEMORY_TYPE_ROCM
        UCS_MEMORY_TYPE_ROCM_MANAGED
        UCS_MEMORY_TYPE_LAST


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
    ctypedef struct ucp_address:
        pass
    ctypedef ucp_address ucp_address_t
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
        UCP_ATTR_FIELD_MEMORY_TYPES
        UCP_FEATURE_RMA
        UCP_FEATURE_WAKEUP
        UCP_WORKER_PARAM_FIELD_THREAD_MODE
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        UCP_EP_PARAM_FIELD_ERR_HANDLER
        UCP_EP_PARAM_FIELD_USER_DATA
        UCP_EP_CLOSE_FLAG_FORCE
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS
        UCP_MEM_MAP_PARAM_FIELD_LENGTH
        UCP_MEM_MAP_PARAM_FIELD_FLAGS
        UCP_MEM_MAP_PARAM_FIELD_PROT
        UCP_MEM_MAP_PROT_LOCAL_READ
        UCP_MEM_MAP_PROT_LOCAL_WRITE
        UCP_MEM_MAP_PROT_REMOTE_READ
        UCP_MEM_MAP_PROT_REMOTE_WRITE
        UCP_OP_ATTR_FIELD_CALLBACK
        UCP_OP_ATTR_FIELD_USER_DATA
        UCP_OP_ATTR_FIELD_FLAGS
        UCP_OP_ATTR_FLAG_NO_IMM_CMPL

    ctypedef enum ucp_err_handling_mode_t:
        UCP_ERR_HANDLING_MODE_NONE
        UCP_ERR_HANDLING_MODE_PEER

    ctypedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status)
    ctypedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data)

    ctypedef struct ucp_params_t:
        uint64_t field_mask
        uint64_t features

    ctypedef struct ucp_context_attr_t:
        uint64_t field_mask
        uint64_t memory_types

    ctypedef struct ucp_worker_params_t:
        uint64_t field_mask
        ucs_thread_mode_t thread_mode

    ctypedef struct ucp_err_handler_t:
        ucp_err_handler_cb_t cb
        void *arg

    ctypedef struct ucp_ep_params_t:
        uint64_t field_mask
        const ucp_address_t *address
        ucp_err_handling_mode_t err_mode
        ucp_err_handler_t err_handler
        void *user_data

    ctypedef struct ucp_mem_map_params_t:
        uint64_t field_mask
        void *address
        size_t length
        unsigned flags
        unsigned prot

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
    ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name, const char *value)
    void ucp_config_print(const ucp_config_t *config, FILE *stream, const char *title,
                          ucs_config_print_flags_t print_flags)
    ucs_status_t ucp_init(const ucp_params_t *params, const ucp_config_t *config,
                          ucp_context_h *context_p)
    void ucp_cleanup(ucp_context_h context)
    ucs_status_t ucp_context_query(ucp_context_h context, ucp_context_attr_t *attr)
    void ucp_context_print_info(const ucp_context_h context, FILE *stream)
    const char *ucp_get_version_string()
    ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
                                   ucp_worker_h *worker_p)
    void ucp_worker_destroy(ucp_worker_h worker)
    unsigned ucp_worker_progress(ucp_worker_h worker)
    ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd)
    ucs_status_t ucp_worker_arm(ucp_worker_h worker)
    ucs_status_t ucp_worker_fence(ucp_worker_h worker)
    ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
                                        size_t *address_length_p)
    void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address)

    # endpoints
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
    ucs_status_ptr_t ucp_put_nbx(ucp_ep_h ep, const void *buffer, size_t count,
                                 uint64_t remote_addr, ucp_rkey_h rkey,
                                 const ucp_request_param_t *param)
    ucs_status_ptr_t ucp_get_nbx(ucp_ep_h ep, void *buffer, size_t count,
                                 uint64_t remote_addr, ucp_rkey_h rkey,
                                 const ucp_request_param_t *param)
    ucs_status_t ucp_request_check_status(void *request)
    void ucp_request_cancel(ucp_worker_h worker, void *request)
    void ucp_request_free(void *request)
