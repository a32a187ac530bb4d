# Enable the gpushare server extension (the JupyterLab panel's REST and live stream).
#
# `pip install gpushare-ext` already drops etc/jupyter/jupyter_server_config.d/gpushare_ext.json
# into the environment, which enables it; this file is for images that install the package
# some other way (an editable install, a source tree on PYTHONPATH) or that want to pin the
# broker socket.  Install it as $PREFIX/etc/jupyter/jupyter_server_config.py, or as
# /etc/jupyter/jupyter_server_config.py for every environment of the host.
c = get_config()  # noqa: F821 - provided by jupyter_server's config loader

c.ServerApp.jpserver_extensions.update({"gpushare_ext": True})

# The broker socket the panel reads; empty means $GPUSHARE_SOCKET, else the system broker
# at /run/gpushare/broker.sock when it exists, else the user's own embedded broker.
c.GpushareServerExtension.socket_path = ""
