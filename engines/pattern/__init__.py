"""A minimal real engine on the SDK: leases memory, fills it with a deterministic pattern, serves its checksum."""
