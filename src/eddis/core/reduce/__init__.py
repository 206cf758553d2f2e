"""The gradient reducers: how one step's buckets are combined over the ranks.

``base`` (the threads, the bucket state and the events every mode shares), ``local`` (one
rank, and mode easgd: nothing to send), ``allreduce`` (MPI), ``sync`` (the SMB servers, or the
ranks in the servers' mapped memory), ``hierarchical`` (sync across nodes), ``adasum_sync``
(Adasum's tree on the servers), ``group`` (mode hybrid: the sync reduction in a group), with
``slots`` (the slot-reduction protocol those four share) and ``join_board`` (who joined);
``registry`` knows the modes and builds one (``make_reducer``). Imports comm and layout only.
"""
