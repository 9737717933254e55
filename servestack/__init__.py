"""servestack: an idempotent pyinfra provisioner for CUDA 13 + SGLang EAGLE-3 GPU inference hosts."""
