"""OnePeFT and the LoRA merges a student runs over the adapters it pulled."""
