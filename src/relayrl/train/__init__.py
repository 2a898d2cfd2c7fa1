"""The trainer's side: the policy's update, the critic, the batch, shared prefixes, devices and FSDP2."""
