"""The GPU side: kernel build and launch (build), one wrapper per kernel family (ops), the
decode-side projection and its planning (projection), CUDA graphs (graphs), workspaces
(workspace), the stages of one call (pipeline), the public layer (layer) and a stack of layers (stack).

A module here imports only from the host side and from modules listed before it."""
