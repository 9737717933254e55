"""pyinfra facts that read a host's state: one module per subject."""
