"""The `holdfast` application: the command line and the demo. The top layer: it imports bench and devstack."""
