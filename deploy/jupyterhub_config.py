# The gpushare part of a JupyterHub configuration (local users, one host).
#
# Use it from your own jupyterhub_config.py, which keeps your authenticator and the rest:
#     load_subconfig("/path/to/gpushare/deploy/jupyterhub_config.py")
# It assumes JupyterHub and gpushare-ext are installed in the same environment (the
# hub's sys.prefix), and that the system broker runs as root on this host
# (deploy/gpushare-broker.service).  Kubernetes: see deploy/kubernetes/z2jh-values.yaml.
import os
import sys

c = get_config()  # noqa: F821 - provided by JupyterHub's config loader

# Single-user servers come from the hub's environment, so every kernel sees the package,
# the system-wide IPython config ($PREFIX/etc/ipython: the %%gpu magic is loaded) and
# the server extension ($PREFIX/etc/jupyter: the JupyterLab panel).
c.Spawner.cmd = [os.path.join(sys.prefix, "bin", "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"

# Pin every kernel to the system broker.  Without it a kernel finds the broker by the
# socket's existence, and a kernel that looked while the broker was restarting would
# start a private embedded broker, outside the shared policy.  With it the kernel waits
# and reconnects instead (and reclaims its leases).
c.Spawner.environment.update({"GPUSHARE_SOCKET": "/run/gpushare/broker.sock"})

# Users' servers (and `!gpushare status` in a notebook) find this environment's commands
# first; otherwise they get the PATH of the hub's own process, root's.
c.Spawner.environment.update(
    {
        "PATH": os.pathsep.join(
            [os.path.join(sys.prefix, "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
        )
    }
)

# The broker identifies users by Unix uid (SO_PEERCRED), so each hub user must be a Unix
# user: the default LocalProcessSpawner runs each server as the user of the same name.
# Create missing users on first login, in the group the policy gives students:
#     c.LocalAuthenticator.create_system_users = True
#     c.LocalAuthenticator.add_user_cmd = ["useradd", "-m", "-G", "students"]
