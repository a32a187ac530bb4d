# Load gpushare in every IPython kernel, so `%%gpu` works without `%load_ext`.
#
# Install system-wide, for every kernel started from this Python environment:
#     install -D -m 0644 deploy/ipython_config.py $PREFIX/etc/ipython/ipython_config.py
# IPython reads <sys.prefix>/etc/ipython (IPython.core.application.ENV_CONFIG_DIRS) and
# /etc/ipython, /usr/local/etc/ipython (SYSTEM_CONFIG_DIRS) before each user's profile,
# so a user may still add extensions of their own; a user who wants it off can set
# `c.InteractiveShellApp.extensions = []` in ~/.ipython/profile_default/ipython_config.py.
#
# Loading is cheap: it registers the magics; the broker is contacted by the first
# `%%gpu` cell or `%gpu status`.
c = get_config()  # noqa: F821 - provided by IPython's config loader

# append (not assign): extensions from other config files are kept.
c.InteractiveShellApp.extensions.append("gpushare_ext")
