"""picofx's passes, one module each; importing this package registers them by name."""
