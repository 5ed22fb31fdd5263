"""The nonlinear query in an attention layer of your own (plain PyTorch, no nlq model)."""

import torch
import torch.nn.functional as F
from torch import nn

from nlq.model.query import NonlinearQuery


class MyAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        # Q = (X + f(X)) / 2 in place of X W_Q; half="explicit" (the default for plain
        # arguments) applies the 1/2 here, since this layer keeps its own 1/sqrt(hs) scale
        self.q = NonlinearQuery(d_model=d_model)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):  # x: (B, T, C), already normalised as in a pre-norm block
        B, T, C = x.shape
        heads = [p.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                 for p in (self.q(x), self.k(x), self.v(x))]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)  # (B, nh, T, hs)
        return self.o(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


if __name__ == "__main__":
    torch.manual_seed(0)
    layer = MyAttention(d_model=64, n_head=4)
    x = F.layer_norm(torch.randn(2, 16, 64), (64,))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    for step in range(20):  # fit a random target: the query's f trains like any module
        loss = (layer(x) - x.flip(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"loss after 20 steps: {loss.item():.4f}")
