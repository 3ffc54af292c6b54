"""One job over many processes (the driver, its workers, the control channel
between them) and the control endpoint of a running job (see README.md)."""
