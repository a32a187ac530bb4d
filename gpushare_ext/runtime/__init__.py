"""What runs inside a notebook kernel: broker client, lease lifecycle, control block, quotas."""
