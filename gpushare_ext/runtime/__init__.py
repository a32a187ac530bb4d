"""What runs inside a notebook kernel: the session and its leases, binding, the gate, quotas,
the launch shim and the long kernels it makes preemptible.  The broker client and the
control block it follows live on the ground floor (``gpushare_ext.client``,
``gpushare_ext.control_block``)."""
