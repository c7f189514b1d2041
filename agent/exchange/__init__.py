"""KNEXA-FL's knowledge exchange: protocols and their registry, AKD packages, teaching, rounds."""
