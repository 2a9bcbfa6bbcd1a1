"""Device code: the GEMV, fused norm/rope/activation kernels, the page copy, attention backends. Importing this
package never needs CUDA.

Hugging Face's `kernels` distribution (a dependency of transformers >= 5.25) has the same import name; where
it is installed too, `import kernels` may find it instead, or a non-editable install may mix the two.
`OWNER` lets the command line tell (coordinator/cli.py)."""

OWNER = "pdserve"
