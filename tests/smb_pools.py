"""What the test workers (MPI ranks, run as scripts from tests/) ask of the SMB servers."""


def pool_left_on_servers(pool):
    """Whether ``pool`` is still on the job's servers (looked up by name, never created)."""
    from eddis.core.comm import connection
    from eddis.errors import SMBKeyError

    try:
        connection.smb_client().pool(pool.name, pool.length, dtype=pool.dtype, slots=pool.slots,
                                  create=False, servers=pool.servers)
    except SMBKeyError:
        return False
    return True
