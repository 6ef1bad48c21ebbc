"""Operations tooling, off the training path: alert rules, dashboards, the local stack, the responder, the CLI.

A training process never imports this package."""
