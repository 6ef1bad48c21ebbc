"""The detection core: fingerprints, identity, configuration, the wire format of the agreement, findings,
episodes, incidents and certificates. Torch and the standard library only: no telemetry, no ops tooling."""
