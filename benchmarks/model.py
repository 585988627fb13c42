"""The benchmarks' CNN: the Fashion-MNIST example's model, owned here so that benchmarks import no example.

``build_logits(images, is_training, width)`` builds five conv + batch-norm +
leaky-ReLU blocks of ``width * 1 .. 5`` channels (strides 1, 2, 2, 1, 1, no
conv bias), a flatten and a dense layer of 10 logits, under the variable scope
``model`` (reused on a second call). Batch norm is
``tf.compat.v1.layers.batch_normalization`` (momentum 0.9, epsilon 1e-5) unless
``batch_norm`` names a drop-in such as ``gradaccum.batch_normalization``.
The figures in ``results.json`` were measured on this model (width 16).
"""
STRIDES = (1, 2, 2, 1, 1)
BN_MOMENTUM = 0.9
BN_EPSILON = 1e-5


def build_logits(images, is_training, width, batch_norm=None, momentum=BN_MOMENTUM):
    """Float32 logits ``[N, 10]`` of ``images`` ``[N, 28, 28, 1]``; a second call reuses the variables.

    Example:
      >>> logits = build_logits(images, True, width=16)
    """
    import tensorflow as tf

    batch_norm = batch_norm or tf.compat.v1.layers.batch_normalization
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        net = images
        for block, stride in enumerate(STRIDES, 1):
            net = tf.compat.v1.layers.conv2d(net, width * block, 3, stride, "same", use_bias=False,
                                             name="conv%d" % block)
            net = batch_norm(net, momentum=momentum, epsilon=BN_EPSILON, training=is_training,
                             name="bn%d" % block)
            net = tf.nn.leaky_relu(net, name="leaky_relu%d" % block)
        net = tf.compat.v1.layers.flatten(net, name="flatten")
        return tf.compat.v1.layers.dense(net, 10, name="logits")
