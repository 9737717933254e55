"""Host-side pyinfra code: one module per step of the upgrade, each exposing a `@deploy`."""
