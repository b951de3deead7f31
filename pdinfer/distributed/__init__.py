"""Data parallelism: a NORMAL engine as a group of rank processes that vote on every step's
type (``dp_group``, ``dp_rank``), behind one front that balances requests over them and
restarts the group when a rank dies (``dp_front``, ``dp_supervisor``, ``front_socket``,
``replica_lb``)."""
