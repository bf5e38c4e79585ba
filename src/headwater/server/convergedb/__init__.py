"""The ConvergeDB listener (entity kinds over TCP)."""
